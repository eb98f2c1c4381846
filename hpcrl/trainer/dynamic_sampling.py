"""DAPO's dynamic sampling (``algorithm.filter_groups``) where an asynchronous run can do it: as the trainer takes
groups.

verl's DAPO trainer generates a batch, drops every group whose metric has zero spread (``np.std == 0`` over its
responses; a group of one is kept), and generates again until ``train_batch_size`` groups are left, failing after
``max_num_gen_batches`` batches ("Generated too many. Please check if your data are too difficult"). Here the
groups arrive one by one from the shards, in commit order, and the trainer takes them for an update until it has R
that vary. So:

- a group without spread is **dropped before it enters an update**: consumed (the cursor moves past it, the
  staleness log has its rows with ``dropped=filter_groups``, ``fully_async/count/dropped_filter_groups`` counts it,
  drops.png draws it), never trained: the exactly-once audit counts it as consumed, not trained, and a resumed
  trainer drops the same groups again (the metric is in the shard, the rule is deterministic);
- its **place in the admission budget is given back** at once (``control/filtered_groups.json``, which
  ``control/admission.py`` subtracts, and the next version's ``consumed_groups`` leaves out), so the fleet keeps
  generating until the trainer has R groups that vary, and the staleness bound holds for those groups;
- the **bound**: ``train/num_gen_batches`` counts the batches of R groups one update has taken; when it reaches
  ``max_num_gen_batches`` (> 0) without R that vary, the trainer records the cause in ``control/fatal.json`` (one
  line) and the run stops there, as on any fatal input error, instead of waiting for groups that never come.

Why the trainer and not the rollout job: the commit is the exactly-once point (a group dropped before its commit
would leave its claim open and its prompt lost or generated again), the trainer sees the one commit order every
writer's groups share (a bound counted per writer would mean nothing with many), and the drop is then the same
decision as the staleness drop beside it.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

import numpy as np

from hpcrl.control.changes import bump
from hpcrl.control.records import FilteredGroups
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.schema import Group

log = logging.getLogger(__name__)

DROPPED = "filter_groups"
"""The staleness log's ``dropped`` value of a group dynamic sampling dropped."""
MAX_STALENESS = "max_staleness"
"""The same for a group older than ``async_training.max_staleness``."""
LAG_BOUND = "lag_bound"
"""The same for a group whose newest token lags by more than the lag bound (the rollout jobs' commit check keeps
such groups out: this holds the bound whatever got past it)."""

Dropped = dict[str, list[Group]]
"""The groups an update took and does not train on, by reason (the staleness log's ``dropped``)."""


def count_dropped(dropped: Dropped) -> int:
    """How many groups ``dropped`` holds, every reason."""
    return sum(len(groups) for groups in dropped.values())


def describe_dropped(dropped: Dropped) -> str:
    """``dropped`` for the trainer's waiting line: ``""`` when none, else ``"; 4 dropped: lag_bound 4"`` (a wait
    whose groups all go to a drop reads as such, not as nothing committed)."""
    n = count_dropped(dropped)
    if not n:
        return ""
    return f"; {n} dropped: " + ", ".join(f"{why} {len(groups)}" for why, groups in sorted(dropped.items()) if groups)


def metric_values(g: Group, reads_reward: bool) -> list[float]:
    """The metric of each trajectory of ``g``: its reward (``seq_reward``) or the value the rollout job recorded
    (``traj/filter_metric``; None, in a shard that lacks it, reads as missing)."""
    if reads_reward:
        return [t.reward for t in g.trajectories]
    return [t.filter_metric if t.filter_metric is not None else math.nan for t in g.trajectories]


def varies(values: list[float]) -> bool:
    """verl's rule: keep a group whose metric has a population std above 0, or that has one value. Missing values
    (NaN: the reward function's result lacked the metric) are left out; with fewer than two left the group is kept
    (nothing says it carries no gradient)."""
    known = [v for v in values if math.isfinite(v)]
    return len(known) < 2 or float(np.std(known)) > 0


class DynamicSampling:
    """The trainer's side of ``algorithm.filter_groups`` (module docstring); off, it keeps every group."""

    def __init__(self, cfg, run_dir: RunDir):
        """``cfg``: the RunConfig."""
        fg = cfg.algorithm.filter_groups
        self.enabled, self.metric, self.max_batches = fg.enable, fg.metric, fg.max_num_gen_batches
        self.reads_reward = fg.reads_reward
        self.groups_per_update = cfg.groups_per_update
        self.run_dir = run_dir

    def keeps(self, g: Group) -> bool:
        """Whether ``g`` may enter an update (always, with dynamic sampling off)."""
        return not self.enabled or varies(metric_values(g, self.reads_reward))

    def gen_batches(self, taken: int) -> int:
        """``train/num_gen_batches``: batches of R groups an update has taken (kept and dropped)."""
        return math.ceil(taken / self.groups_per_update)

    def room(self, taken: int) -> int:
        """How many more groups one update may take after ``taken`` before the bound is checked (no limit: a
        large number), so that the check falls exactly after ``max_num_gen_batches`` batches."""
        if not self.enabled or self.max_batches <= 0:
            return 2**31
        return max(self.max_batches * self.groups_per_update - taken, 0)

    def exhausted(self, taken: int, kept: int, step: int) -> Optional[str]:
        """The one line that stops the run when an update has taken ``max_num_gen_batches`` batches of R groups and
        still has fewer than R that vary (verl: the check after each generated batch); None while it may go on (and
        always with no limit)."""
        R = self.groups_per_update
        if not self.enabled or self.max_batches <= 0 or kept >= R or taken < self.max_batches * R:
            return None
        return (f"dynamic sampling (algorithm.filter_groups, metric {self.metric}) took {taken} groups = "
                f"{self.gen_batches(taken)} batches of R={R} for update {step + 1} and only {kept} of them varied in "
                f"{self.metric}: in every other group all responses scored alike, so the data and reward no longer "
                f"fill an update; check the reward (does it ever differ between responses?) and how hard the data is, "
                f"or raise algorithm.filter_groups.max_num_gen_batches ({self.max_batches}; 0: no limit)")

    def give_back(self, dropped_groups: int) -> None:
        """Record that ``dropped_groups`` groups were dropped so far (completed updates' and the current one's):
        admission gives their places back (``control/filtered_groups.json``); rollout jobs waiting on the budget
        look again."""
        if not self.enabled:
            return
        write_json_atomic(self.run_dir.filtered_groups, FilteredGroups(dropped_groups, time.time()).to_json())
        bump(self.run_dir, f"{dropped_groups} groups without spread dropped: their budget given back", "trainer")


def sort_taken(groups: list[Group], kept: list[Group], dropped: Dropped, version: int, cfg,
               sampling: "DynamicSampling", filtered_before: int) -> None:
    """The trainer's rank 0: each group taken goes to ``kept`` or to ``dropped`` under its reason (lags against
    ``version``, the one the update starts from): its newest token more than ``RunConfig.max_lag_bound`` versions old
    (the rollout jobs' commit refuses such groups, ``control/admission.py``: this holds the bound whatever got past
    them), its oldest more than ``async_training.max_staleness``, or without spread (dynamic sampling: its admission
    place is given back at once; ``filtered_before`` is the run's count before this update)."""
    max_st = cfg.async_training.max_staleness
    filtered = len(dropped.get(DROPPED, ()))
    for g in groups:
        if 0 <= g.version_end < version - cfg.max_lag_bound:  # version_end -1: no token, no lag
            dropped.setdefault(LAG_BOUND, []).append(g)
        elif max_st is not None and version - g.version_start > max_st:
            dropped.setdefault(MAX_STALENESS, []).append(g)
        elif not sampling.keeps(g):
            dropped.setdefault(DROPPED, []).append(g)
        else:
            kept.append(g)
    if len(dropped.get(DROPPED, ())) > filtered:
        sampling.give_back(filtered_before + len(dropped[DROPPED]))
