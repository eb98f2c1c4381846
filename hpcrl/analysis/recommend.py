"""One recommendation line from the idle ratios (verl's rule: move resources toward
the side with the *lower* idle ratio; that side is the bottleneck).

Idle ratios are time-weighted over the whole run (``tables.trainer_idle`` and
``tables.rollout_idle``). With ``t`` = trainer idle and ``r`` = rollout idle:

- both above :data:`HIGH`: neither side is saturated; they wait on each other
  (more GPUs on the busier side would not remove the other's waits).
  If the budget lets the fleet run less than one update ahead
  (``B - K*R < R`` groups), the knob is ``staleness_threshold``; otherwise the
  hand-off latency or ``rollout.max_concurrent_groups`` limits the overlap;
- one side above :data:`HIGH` and the other at least :data:`MARGIN` lower:
  the busier side is the bottleneck; move GPUs toward it. The idle side could
  absorb up to ``1 / (1 - idle)`` times the current rate. On a live run the line names the exact
  ``hpcrl scale RUN --rollout-jobs N`` (N from the fleet now, ``analysis/fleet.py``) and what one more writer
  adds (the groups/s one writer committed in the last window);
- both at or below :data:`HIGH`: balanced; more throughput needs more of both.

Before these, the admission budget: where the run's budget-aware bound (``budget_bound.py``) is more than
:data:`BUDGET_BINDS` times its ideal-overlap bound, the chain publish -> switch -> the groups the budget held
back -> update sets the step, whatever the idle ratios say (the trainer waits, yet another rollout job would
shorten only the groups' latency in that chain): the knob is ``staleness_threshold``, and the line names the
smallest one (in steps of 0.25) at which the chain no longer binds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hpcrl.analysis import tables
from hpcrl.analysis.ceiling import Ceiling, run_ceiling
from hpcrl.analysis.fleet import fleet_history
from hpcrl.analysis.load import RunData
from hpcrl.config.knobs import AUTO, Knobs, admission_budget, max_lag_bound
from hpcrl.rundir.paths import RunDir
from hpcrl.logs import metric_names as M

HIGH = 0.3
"""An idle ratio above this is a side waiting for the other a significant share of its time."""
MARGIN = 0.15
"""Idle ratios closer than this are treated as equal (no clear bottleneck side)."""
BUDGET_BINDS = 1.05
"""A budget-aware bound this many times the ideal-overlap bound: the admission budget sets the pace."""


@dataclass
class Recommendation:
    """The bottleneck side and the knob to turn, with the numbers it rests on."""

    bottleneck: str
    """``rollout``, ``trainer``, ``neither`` (they wait on each other), ``budget`` (the admission budget's chain
    sets the step), ``balanced`` or ``unknown``."""
    line: str
    """One sentence with the action and the numbers it was derived from."""
    action: str = ""
    """What to change, in a few plain words (the report's first lines, ``analysis/glance.py``)."""


def _min_s_for_full_update(k: Knobs) -> float:
    """Smallest staleness_threshold with floor(s*K*R) >= R: the fleet can prepare a whole update ahead."""
    kr = k.trigger_parameter_sync_step * k.groups_per_update
    return k.groups_per_update / kr


@dataclass
class FleetNow:
    """What the rollout-bound and trainer-bound lines need of the fleet (``analysis/fleet.py``)."""

    run: str
    """The run directory, as ``hpcrl scale`` takes it."""
    live: bool
    """The run has not finished: ``hpcrl scale`` can change its fleet now."""
    writers: int
    """Rollout jobs in the fleet now (at the end, for a finished run)."""
    per_writer_groups_s: float = math.nan
    """Groups/s one writer committed, on average over the last window with writers."""


def _more_writers(k: Knobs, fleet: Optional[FleetNow]) -> str:
    """How to add a rollout job: the exact ``hpcrl scale`` command on a live run, the config key otherwise."""
    n = fleet.writers if fleet is not None and fleet.writers > 0 else k.rollout_jobs
    if fleet is None:
        return (f"resources.rollout_jobs {n} -> {n + 1}, on a live run `hpcrl scale RUN --rollout-jobs {n + 1}`, or "
                "more GPUs per rollout job")
    rate = ("" if math.isnan(fleet.per_writer_groups_s) else
            f": {'the writer commits' if n == 1 else f'each of the {n} writers commits'} "
            f"~{fleet.per_writer_groups_s:.2f} groups/s, so one more adds ~"
            f"{fleet.per_writer_groups_s:.2f} groups/s while the trainer waits")
    if fleet.live:
        return f"`hpcrl scale {fleet.run} --rollout-jobs {n + 1}`{rate}; or more GPUs per rollout job"
    return (f"resources.rollout_jobs {n} -> {n + 1} in the next run (this one has finished; on a live run `hpcrl "
            f"scale RUN --rollout-jobs N`){rate}; or more GPUs per rollout job")


def _more_writers_short(k: Knobs, fleet: Optional[FleetNow]) -> str:
    """:func:`_more_writers` in a few words."""
    n = fleet.writers if fleet is not None and fleet.writers > 0 else k.rollout_jobs
    if fleet is not None and fleet.live:
        return f"`hpcrl scale {fleet.run} --rollout-jobs {n + 1}`"
    return f"resources.rollout_jobs {n} -> {n + 1} (or more GPUs per rollout job)"


def _cap(k) -> str:
    """``rollout.max_concurrent_groups`` as the run has it (``auto``: with the bound it gives)."""
    return str(k.max_concurrent_groups) if k.max_concurrent_groups != AUTO else f"auto: {k.group_bound} per job"


def recommend(t: float, r: float, k: Optional[Knobs], why_unknown: str = "",
              fleet: Optional[FleetNow] = None) -> Recommendation:
    """The recommendation for trainer idle ratio ``t`` and rollout idle ratio ``r`` (``fleet``: the run's fleet, so
    that a rollout-bound line names the exact ``hpcrl scale`` command)."""
    if math.isnan(t) or math.isnan(r):
        have = "trainer" if not math.isnan(t) else "rollout" if not math.isnan(r) else "neither side"
        return Recommendation("unknown", f"No recommendation: the idle ratio is known for {have} only "
                                         f"({why_unknown or 'the run has not logged both sides yet'}).",
                              "nothing yet: the logs do not show both sides' waits")
    nums = _nums(t, r)
    if t > HIGH and r > HIGH:
        if k is None:
            return Recommendation("neither", f"Neither side is saturated: {nums}; they wait on each other. "
                                             "Let generation overlap training: raise staleness_threshold.",
                                  "raise async_training.staleness_threshold, so generation runs ahead of training")
        kr = k.trigger_parameter_sync_step * k.groups_per_update
        ahead = k.admission_budget - kr
        if ahead < k.groups_per_update:
            s_new = _min_s_for_full_update(k)
            budget_new = admission_budget(s_new, k.trigger_parameter_sync_step, k.groups_per_update)
            return Recommendation("neither", (
                f"Neither side is the bottleneck, they wait on each other: {nums}. The budget B={k.admission_budget} "
                f"lets the rollout fleet generate only {ahead} group(s) ahead of the K*R={kr} a version consumes, "
                f"fewer than the R={k.groups_per_update} the next update needs: raise "
                f"async_training.staleness_threshold from {k.staleness_threshold:g} to at least {s_new:g} "
                f"(lag bound then {max_lag_bound(budget_new, kr)} version(s)); "
                "moving GPUs would not help."),
                f"raise async_training.staleness_threshold from {k.staleness_threshold:g} to {s_new:g}, so generation "
                "can run a whole update ahead of training")
        return Recommendation("neither", (
            f"Neither side is the bottleneck, they wait on each other: {nums}, although the budget "
            f"B={k.admission_budget} already allows a whole update ({k.groups_per_update} groups) ahead. The "
            f"hand-off limits the overlap: raise rollout.max_concurrent_groups (now {_cap(k)}) "
            "or lower timeouts.poll_interval_s / rollout.seal_interval_s; moving GPUs would not help."),
            f"raise rollout.max_concurrent_groups (now {_cap(k)}), so more groups are in flight")
    if t > HIGH and t - r >= MARGIN:
        extra = "" if k is None else _more_writers(k, fleet)
        return Recommendation("rollout", (
            f"The rollout side is the bottleneck: {nums}. Move GPUs from the trainer to rollout"
            f"{' (' + extra + ')' if extra else ''}; the trainer could absorb up to {1 / max(1 - t, 1e-9):.1f}x "
            "the current sample rate."),
            "more generation: " + (_more_writers_short(k, fleet) if k else "more rollout GPUs"))
    if r > HIGH and r - t >= MARGIN:
        n = fleet.writers if fleet is not None and fleet.writers > 0 else k.rollout_jobs if k else 0
        fewer = ("" if n < 2 else f": `hpcrl scale {fleet.run} --rollout-jobs {n - 1}`" if fleet is not None and fleet.live
                 else f": on a live run `hpcrl scale RUN --rollout-jobs {n - 1}`")
        return Recommendation("trainer", (
            f"The trainer is the bottleneck: {nums}. Move GPUs from rollout to the trainer (more trainer GPUs "
            f"or fewer rollout jobs{fewer}); the rollout fleet could generate up to {1 / max(1 - r, 1e-9):.1f}x what "
            "the trainer consumes. Raising staleness_threshold would only add lag."),
            "more training: give the trainer more GPUs" + (f", or run fewer rollout jobs{fewer}" if n >= 2 else ""))
    return Recommendation("balanced", (
        f"Balanced: {nums}; both sides are busy most of the time (idle at most {HIGH:.2f}), so keep the split; "
        "more throughput needs more GPUs on both sides."),
        "nothing in the split: more throughput needs more GPUs on both sides")


def _nums(t: float, r: float) -> str:
    return (f"trainer idle {t:.2f} (share of its time waiting for samples), rollout idle {r:.2f} "
            f"(share of its time with nothing in flight, waiting for weights or budget)")


def budget_binds(t: float, r: float, k: Knobs, c: Optional[Ceiling]) -> Optional[Recommendation]:
    """The recommendation where the admission budget, not a pool, sets the step (module docstring); else None."""
    if c is None or c.budget is None or c.budget_bound_s <= BUDGET_BINDS * c.bound_s:
        return None
    ch, ideal = c.budget, c.bound_s / c.updates
    line = (f"The admission budget sets the pace: {_nums(t, r)}. With B={ch.B} groups per version (s="
            f"{k.staleness_threshold:g}) a step cannot beat {ch.per_update_s:.2f}s ({ch.describe()}), above the "
            f"{ideal:.2f}s per update both pools' work allows; the run reaches {c.budget_ratio:.2f} of that. Moving "
            "GPUs would shorten only the groups' latency in that chain")
    kr = ch.K * ch.R
    for s_new in (k.staleness_threshold + 0.25 * i for i in range(1, 13)):
        chain = ch.with_staleness(s_new)
        if chain.per_update_s <= ideal:
            lag = max_lag_bound(chain.B, kr)
            return Recommendation("budget", line + (
                f"; raise async_training.staleness_threshold to {s_new:g} (B={chain.B}, lag bound {lag} "
                f"version(s)), where the chain allows {chain.per_update_s:.2f}s and the pools' work binds."),
                f"raise async_training.staleness_threshold from {k.staleness_threshold:g} to {s_new:g}, so the "
                "budget lets generation run further ahead (more GPUs would not help)")
    return Recommendation("budget", line + "; raise async_training.staleness_threshold.",
                          "raise async_training.staleness_threshold, so the budget lets generation run further ahead")


def recommend_run(data: RunData) -> Recommendation:
    m, ro = data.metrics, data.rollout
    t, r = tables.trainer_idle(m) if not m.empty else math.nan, tables.rollout_idle(ro) if not ro.empty else math.nan
    why = [data.unavailable("trainer idle ratio", metrics=tables.STEP_PARTS),
           data.unavailable("rollout idle ratio", rollout=["wall_s", M.ROLLOUT_IDLE_RATIO])]
    if data.knobs is not None and not (math.isnan(t) or math.isnan(r)):
        try:
            c = run_ceiling(data)
        except KeyError:  # logs of an older hpcrl
            c = None
        budget = budget_binds(t, r, data.knobs, c)
        if budget is not None:
            return budget  # scaling the fleet would not help: the line says so and never names `hpcrl scale`
    return recommend(t, r, data.knobs, " ".join(w.rstrip(".") for w in why if w), fleet_now(data))


def fleet_now(data: RunData) -> Optional[FleetNow]:
    """The fleet of ``data``'s run now (None when no writer joined or committed yet)."""
    h = fleet_history(RunDir(data.root))
    if not h.lives:
        return None
    live = not data.finished
    writers = sum(life.left_s is None for life in h.lives) if live else data.knobs.rollout_jobs if data.knobs else 0
    rates = [x for x in h.windows(10) if x.writers]
    last = rates[-1] if rates else None
    per = last.total_per_s / last.writers if last is not None and last.total_per_s > 0 else math.nan
    return FleetNow(str(data.root), live, writers, per)
