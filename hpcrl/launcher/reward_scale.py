"""Resizing the reward jobs of a live run (``hpcrl scale RUN --reward-jobs N``, ``resources.reward_jobs``).

A reward job holds no state, so its fleet is simpler than the rollout fleet (``fleet.py``): the frozen config's
``resources.reward_jobs`` is the size; reward job ``i`` serves while ``i`` is below it and ends by itself (``drained``,
its service record withdrawn: its clients send their requests to the others) once it is not (``hpcrl/reward/job.py``
reads the frozen config again when ``control/changes.jsonl`` grows). Growing submits the new indices: the launcher
following the run submits their jobs (submitit), ``hpcrl scale`` without one submits one ``sbatch/reward.sbatch``
array (or prints the line when sbatch is not on PATH). A drained reward job is not resubmitted.
"""
from __future__ import annotations

import shutil
from typing import Callable

from hpcrl.config import RunConfig
from hpcrl.control.changes import bump
from hpcrl.launcher.fleet import StartError, submit_array
from hpcrl.rundir.paths import RunDir


Start = Callable[[list[int]], list[str]]
"""Starts the reward jobs of these indices; their job ids."""


def resize_reward_jobs(cfg: RunConfig, rd: RunDir, n: int, by: str, start: Start, emit: Callable[[str], None]
                       ) -> list[str]:
    """``resources.reward_jobs`` becomes ``n`` (module docstring); the job names started. ValueError for a run
    without reward jobs or ``n`` < 1; StartError (the config unchanged) when the new jobs cannot be started."""
    rm = cfg.reward_model
    if not (rm.enable and rm.placement == "job"):
        raise ValueError("this run has no reward jobs (reward_model.enable with reward_model.placement=job)")
    if n < 1:
        raise ValueError(f"reward_jobs must be >= 1, got {n}: the rollout jobs need a reward job to score their "
                         "groups")
    old = cfg.resources.reward_jobs
    started = []
    if n > old:
        for i, job_id in zip(range(old, n), start(list(range(old, n)))):
            emit(f"scale: {RunDir.reward_job(i)} submitted as {job_id} ({by})")
            started.append(RunDir.reward_job(i))
    if n != old:
        cfg.resources.reward_jobs = n
        rd.freeze_config(cfg, (f"resources.reward_jobs: {old} -> {n} ({by})",))
        bump(rd, "reward jobs resized", by)  # the reward jobs beyond n end (drained) at their next look
    emit(f"scale: the reward jobs go from {old} to {n} ({by})")
    return started


def sbatch_start(cfg: RunConfig, rd: RunDir, scripts, python: str) -> Start:
    """Without a launcher: one reward job array of the new indices through sbatch (StartError with the line
    without it)."""
    from hpcrl.launcher.sbatch_lines import reward_line

    def start(ids: list[int]) -> list[str]:
        line = reward_line(cfg, rd, scripts, python, ids)
        if shutil.which("sbatch") is None:
            raise StartError(f"sbatch is not on PATH: submit the new reward jobs with\n{line}")
        array = submit_array(line)
        return [f"{array}_{i}" for i in ids]

    return start
