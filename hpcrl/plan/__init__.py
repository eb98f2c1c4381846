"""``hpcrl plan``: predict, without running anything, how a run of a given phase model behaves for each
trainer:rollout split and async setting (``pipeline.py``: the event simulation; ``sweep.py``: the candidates,
the probe-run fit and the command). Above the jobs: it reads configs and run directories, starts nothing."""
