"""Offline analysis of run directories and the live status view.

- :mod:`hpcrl.analysis.load`       read a run directory tolerantly (RunData, RunFormatError)
- :mod:`hpcrl.analysis.tables`     every number of the report, defined from the raw logs
- :mod:`hpcrl.analysis.recommend`  the bottleneck / knob recommendation from the idle ratios
- :mod:`hpcrl.analysis.plots`      one PNG per view of one run; :mod:`~hpcrl.analysis.compare` overlays runs
- :mod:`hpcrl.analysis.report`     ``hpcrl report RUN_DIR ... --out DIR`` (Markdown + HTML)
- :mod:`hpcrl.analysis.status`     ``hpcrl status RUN_DIR`` (plain text, refreshing)
- :mod:`hpcrl.analysis.problems`   reward errors, tool errors, prompts filtered (status and the report)
- :mod:`hpcrl.analysis.samples`    ``hpcrl samples RUN_DIR``: prompts, responses, rewards decoded from the shards
- :mod:`hpcrl.analysis.export`     ``hpcrl export RUN_DIR --out DIR``: a weight version as a Hugging Face folder
- :mod:`hpcrl.analysis.commands`   those commands' arguments and how each runs (hpcrl/cli.py adds them)

The commands are ``hpcrl report``, ``status``, ``summary``, ``samples`` and ``export`` (hpcrl/cli.py);
this package is library code (only the ``*_main`` functions print what their command shows). Nothing
here imports DeepSpeed; only ``samples`` and ``export`` load transformers (the tokenizer): the rest runs on a
login node with pandas and matplotlib. The notebook and scripts a user runs on top are in the repository's
``analysis/`` folder.
"""
