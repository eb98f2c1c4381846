"""The evaluation role: held-out validation of the published weight versions (ARCHITECTURE.md, code map).

``job.py`` is the evaluation job (a third job of a run, on its own allocation: it follows the versions with a
weight subscriber and never makes the trainer wait); ``offline.py`` is ``hpcrl eval`` (any version still on
disk, or any model folder, with the same code); ``evaluate.py`` generates and scores one version,
``metrics.py`` computes verl's validation metrics, ``schedule.py`` decides which versions are due, ``data.py``
reads the held-out prompts, ``parts.py`` builds what an evaluation holds, ``writer.py`` appends the records of
``hpcrl/logs/eval_log.py``. It uses the rollout job's engines, agent loops, data and reward code; neither the
trainer nor the rollout job imports it, and nothing in the bottom layer does.
"""
