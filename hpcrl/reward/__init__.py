"""Rewards from a learned model: the reward job and its service, and the client side the rollout and evaluation
jobs use (``scoring.py``). See ``job.py`` for the job, ``wire.py`` for what crosses between the jobs, and
docs/reward-models.md for the user's side."""
