"""The async knobs of a run and the flow-control arithmetic that follows from them, written once.

verl's ``fully_async_policy`` names: ``staleness_threshold`` (s), ``trigger_parameter_sync_step`` (K),
``ppo_mini_batch_size * require_batches`` (R groups per trainer update). From them:

- ``K * R`` groups are consumed between two weight versions;
- the admission budget ``B = floor((1 + s) * K * R)``: while a rollout job holds version ``v`` the fleet may
  have started at most ``consumed_groups(v) + B`` groups (``control/admission.py`` enforces it, the planner
  simulates it, the budget-aware bound and the report reason with it);
- the lag bound of one writer, ``floor((B - 1) / (K * R))`` versions (docs/weights-and-samples.md, "The lag bound");
- how the fleet shares a version's budget (:func:`may_start`): by load, each live rollout job up to an even
  share of what the budget lets the fleet have in flight (:func:`share_level`), under a per-job bound
  (:func:`group_bound`: ``rollout.max_concurrent_groups``, ``auto`` by default);
- the latest trainer version a committed group can be trained at (:func:`latest_trainer_version`), which the
  rollout job's commit checks against the lag bound.

:func:`admission_budget` is the only place the budget is computed (``tests/test_rules_once.py`` fails on a copy of
the formula anywhere else): :class:`Knobs`, ``RunConfig``, ``hpcrl plan`` and the analysis all call it. The share
is written once too: ``control/admission.py`` applies :func:`starts_allowed` (:func:`may_start` start after
start) under one acquisition of its lock, ``hpcrl plan``'s simulations call the same function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from hpcrl.config.names import FIRST_COME, SHARE_BY_LOAD

AUTO = "auto"
"""``rollout.max_concurrent_groups: auto``: the per-job bound follows from the engine and the budget."""

FLOAT_SLACK = 1e-9
"""Added before the floor so that a product the decimals make whole (s=0.4, K*R=15: 20.999999999999996) counts
as whole: the budget is the exact product's floor (verl's ``int()`` of the float product is one group less)."""


def admission_budget(staleness_threshold: float, trigger_parameter_sync_step: int, groups_per_update: int) -> int:
    """``B = floor((1 + s) * K * R)``: groups the fleet may start per weight version (module docstring)."""
    return math.floor((1.0 + staleness_threshold) * trigger_parameter_sync_step * groups_per_update + FLOAT_SLACK)


def max_lag_bound(budget: int, groups_per_version: int) -> int:
    """Largest lag (versions) of a group's newest token that budget ``B`` allows one writer:
    ``floor((B - 1) / (K * R))``."""
    return (budget - 1) // groups_per_version


def group_bound(max_concurrent_groups: Union[int, str], budget: int, max_num_seqs: int, n: int) -> int:
    """Groups one rollout job may have in flight at most: ``rollout.max_concurrent_groups``, or with ``auto`` the
    groups its engine decodes at once (``ceil(max_num_seqs / n)``), never more than the budget ``B`` (the fleet
    never has more than ``B`` groups in flight)."""
    if max_concurrent_groups != AUTO:
        return int(max_concurrent_groups)
    return max(1, min(budget, -(-max_num_seqs // n)))


def share_level(fleet_in_flight: int, budget_left: int, jobs: int) -> int:
    """The even share: ``ceil((F + left) / jobs)`` groups in flight per job, where ``F`` is what the live jobs
    have in flight and ``left`` the starts the budget still allows. ``F + left`` does not change when a group
    starts (one moves from ``left`` to ``F``), so every job that asks at the same instant sees the same level;
    it falls as groups are committed and rises when a version lands (``left`` grows) or a job leaves."""
    return -(-(fleet_in_flight + max(budget_left, 0)) // max(jobs, 1))


def may_start(rule: str, own_in_flight: int, bound: int, budget_left: int, fleet_in_flight: int, jobs: int) -> bool:
    """Whether a rollout job with ``own_in_flight`` groups may start one more: the budget has a start left
    (``started - skipped < consumed_groups(v) + B``, ``budget_left > 0``), the job is below its ``bound``
    (:func:`group_bound`) and, sharing by load, below the even share of the ``jobs`` live jobs
    (:func:`share_level`). First come: the bound alone (the first jobs to ask may take the whole budget).

    The one description of the rule: through :func:`starts_allowed`, ``control/admission.py`` applies it under the
    admission lock with the record's counts, ``hpcrl plan`` with its simulated jobs'."""
    if budget_left <= 0 or own_in_flight >= bound:
        return False
    return rule == FIRST_COME or own_in_flight < share_level(fleet_in_flight, budget_left, jobs)


def starts_allowed(rule: str, own_in_flight: int, bound: int, budget_left: int, fleet_in_flight: int, jobs: int,
                   most: Optional[int] = None) -> int:
    """How many groups a rollout job that asks once may start (at most ``most``; None: no limit of its own):
    :func:`may_start` applied start after start, each one moving a group from ``budget_left`` into the job's and
    the fleet's in flight. A job takes them all in one turn, so jobs that ask at the same instant are served one
    after another, each as far as the rule lets it: ``control/admission.py`` starts them under one acquisition
    of the admission lock (one read and one write of the record), ``hpcrl plan`` in one service of the job. With
    ``first_come`` the first job to ask takes up to its bound; by load the share does not move as a job starts
    (:func:`share_level`), so the order changes nothing."""
    n = 0
    while (most is None or n < most) and may_start(rule, own_in_flight + n, bound, budget_left - n,
                                                   fleet_in_flight + n, jobs):
        n += 1
    return n


def latest_trainer_version(position: int, version: int, consumed: int, groups_per_version: int) -> int:
    """The latest trainer version at which the ``position``-th group to be consumed (1-based, in commit order) can
    be trained, knowing that ``version`` was published after ``consumed`` groups: a version consumes at least
    ``K * R`` more (exactly that many, less what the trainer drops), so the group is taken while the trainer
    holds a version ``u`` with ``consumed(u) < position``:
    ``u <= version + ceil((position - consumed) / (K*R)) - 1``."""
    return version + max(0, -(-(position - consumed) // groups_per_version) - 1)


def late_for_bound(newest_token: int, position: int, version: int, consumed: int, groups_per_version: int,
                   bound: int) -> bool:
    """A group whose newest token was sampled under ``newest_token``, committed at ``position``, could be trained
    more than ``bound`` versions after that token (:func:`latest_trainer_version`): it must not be committed as
    it is (the rollout job carries it into the newest version or generates it again)."""
    return latest_trainer_version(position, version, consumed, groups_per_version) - newest_token > bound


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """A run's async knobs and what follows from them: ``RunConfig.knobs`` builds it from a config; the analysis
    (report, status, plots, the recommendation) reads a run's through it."""

    staleness_threshold: float
    """s (``async_training.staleness_threshold``)."""
    trigger_parameter_sync_step: int = 1
    """K: trainer updates per weight version (``async_training.trigger_parameter_sync_step``)."""
    ppo_mini_batch_size: int = 4
    """Groups per mini-batch (``actor.ppo_mini_batch_size``)."""
    require_batches: int = 1
    """Mini-batches per update (``async_training.require_batches``)."""
    partial_rollout: bool = False
    """``async_training.partial_rollout``: groups in flight continue under the next version."""
    max_staleness: Optional[int] = None
    """``async_training.max_staleness``: older trajectories are dropped (None: never)."""
    n: int = 8
    """Responses per prompt (``rollout.n``)."""
    rollout_jobs: int = 1
    """Rollout jobs at launch (``resources.rollout_jobs``)."""
    max_concurrent_groups: Union[int, str] = AUTO
    """Groups one rollout job has in flight at most (``rollout.max_concurrent_groups``; ``auto``:
    :func:`group_bound`)."""
    budget_share: str = SHARE_BY_LOAD
    """How the fleet shares a version's budget (``rollout.budget_share``: :func:`may_start`)."""
    max_num_seqs: int = 256
    """Sequences an engine decodes at once (``rollout.max_num_seqs``; the ``auto`` bound's engine)."""
    total_rollout_steps: int = 0
    """Groups the run trains on (``rollout.total_rollout_steps``)."""
    simulated: str = ""
    """What of the run is simulated (``engine``, ``trainer``, ``engine and trainer``); empty for a real run."""
    time_scale: float = 1.0
    """A simulated run's modelled seconds per wall second (``simulated.time_scale``); 1 for a real run."""

    @property
    def groups_per_update(self) -> int:
        """R = ppo_mini_batch_size * require_batches."""
        return self.ppo_mini_batch_size * self.require_batches

    @property
    def groups_per_version(self) -> int:
        """K * R: groups the trainer consumes between two weight versions."""
        return self.trigger_parameter_sync_step * self.groups_per_update

    @property
    def admission_budget(self) -> int:
        """B (:func:`admission_budget`)."""
        return admission_budget(self.staleness_threshold, self.trigger_parameter_sync_step, self.groups_per_update)

    @property
    def max_lag_bound(self) -> int:
        """The lag bound of one writer (:func:`max_lag_bound`)."""
        return max_lag_bound(self.admission_budget, self.groups_per_version)

    @property
    def group_bound(self) -> int:
        """Groups one rollout job may have in flight at most (:func:`group_bound`)."""
        return group_bound(self.max_concurrent_groups, self.admission_budget, self.max_num_seqs, self.n)

    @property
    def total_updates(self) -> int:
        """Trainer updates in the run: total_rollout_steps // R."""
        return self.total_rollout_steps // self.groups_per_update

    def describe(self) -> str:
        """One line for the report and ``hpcrl status``."""
        return (f"s={self.staleness_threshold:g}, K={self.trigger_parameter_sync_step}, R={self.groups_per_update}, "
                f"B={self.admission_budget} groups per version, max lag bound {self.max_lag_bound}, "
                f"{self.total_updates} updates, n={self.n}, {self.rollout_jobs} rollout job(s)")
