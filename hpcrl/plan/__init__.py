"""``hpcrl plan``: predict, without running anything, how a run of a given phase model behaves for each
trainer:rollout split and async setting (``events.py``: the event simulation, ``model.py``: what it shares with the
tests' reference one; ``sweep.py``: the candidates, the probe-run fit and the command). Above the jobs: it reads
configs and run directories, starts nothing."""
