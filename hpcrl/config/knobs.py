"""The async knobs of a run and the flow-control arithmetic that follows from them, written once.

verl's ``fully_async_policy`` names: ``staleness_threshold`` (s), ``trigger_parameter_sync_step`` (K),
``ppo_mini_batch_size * require_batches`` (R groups per trainer update). From them:

- ``K * R`` groups are consumed between two weight versions;
- the admission budget ``B = floor((1 + s) * K * R)``: while a rollout job holds version ``v`` the fleet may
  have started at most ``consumed_groups(v) + B`` groups (``control/admission.py`` enforces it, the planner
  simulates it, the budget-aware bound and the report reason with it);
- the lag bound of one writer, ``floor((B - 1) / (K * R))`` versions (docs/weights-and-samples.md, "The lag bound").

:func:`admission_budget` is the only place the budget is computed (``tests/test_layers.py`` fails on a copy of
the formula anywhere else): :class:`Knobs`, ``RunConfig``, ``hpcrl plan`` and the analysis all call it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

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
    max_concurrent_groups: int = 8
    """Groups one rollout job has in flight at most (``rollout.max_concurrent_groups``)."""
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
    def total_updates(self) -> int:
        """Trainer updates in the run: total_rollout_steps // R."""
        return self.total_rollout_steps // self.groups_per_update

    def describe(self) -> str:
        """One line for the report and ``hpcrl status``."""
        return (f"s={self.staleness_threshold:g}, K={self.trigger_parameter_sync_step}, R={self.groups_per_update}, "
                f"B={self.admission_budget} groups per version, max lag bound {self.max_lag_bound}, "
                f"{self.total_updates} updates, n={self.n}, {self.rollout_jobs} rollout job(s)")
