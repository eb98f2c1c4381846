"""The reward model's part of ``hpcrl report`` and ``hpcrl status``: what each reward job did (``logs/<reward
job>.jsonl``, its heartbeat) and what the rollout jobs waited for it (their version rows), in a few lines."""
from __future__ import annotations

import math

import pandas as pd

from hpcrl.logs import metric_names as M
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.rundir.paths import RunDir


def reward_job_lines(rd: RunDir) -> list[str]:
    """One line per reward job that logged a row: responses scored, requests, idle share, responses/s computing."""
    lines = []
    for job, path in rd.reward_metrics_logs().items():
        rows = list(read_jsonl(path))
        if not rows:
            continue
        r = rows[-1]
        lines.append(f"{job}: {r.get(M.REWARD_JOB_ITEMS, 0)} responses scored in {r.get(M.REWARD_JOB_REQUESTS, 0)} "
                     f"requests, idle {r.get(M.REWARD_JOB_IDLE_RATIO, math.nan):.2f} of its time, "
                     f"{r.get(M.REWARD_JOB_ITEMS_PER_S, 0.0):.0f} responses/s while computing, batches of up to "
                     f"{r.get(M.REWARD_JOB_QUEUE_MAX, 0)}")
    return lines


def rollout_wait_line(rollout: pd.DataFrame) -> str:
    """How long the rollout jobs' groups waited for the reward model ('' when no row scored with one)."""
    if rollout.empty or M.REWARD_MODEL_GROUPS not in rollout:
        return ""
    groups = rollout[M.REWARD_MODEL_GROUPS].fillna(0).sum()
    if not groups:
        return ""
    waited = rollout[M.TIMING_REWARD].fillna(0).sum()
    problems = int(rollout[M.REWARD_MODEL_PROBLEMS].fillna(0).sum())
    retries = int(rollout.groupby(M.WRITER)[M.REWARD_MODEL_RETRIES].max().fillna(0).sum()) \
        if M.REWARD_MODEL_RETRIES in rollout else 0
    return (f"reward model: {int(groups)} groups scored, {waited / groups:.3f}s per group waiting for their scores "
            f"({waited:.0f}s in all, while the engine generated others); {problems} responses without a score; "
            f"{retries} requests sent again")
