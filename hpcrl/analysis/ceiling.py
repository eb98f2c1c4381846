"""The ideal-overlap ceiling of a run, from its own phase times (``hpcrl report``, ``bench/bench_async.py``).

With the trainer and the rollout jobs on separate pools, each pool must still do its own work in sequence:
the rollout pool generates the samples (its busy time, spread over its jobs) and loads every weight version
(the switch: a rollout job cannot generate while it loads), and the trainer updates and publishes. Perfectly
overlapped, the run cannot be shorter than the slower pool's work::

    bound = max(generation + weight switch, update + publish)

where generation is the rollout jobs' busy time (``wall_s * (1 - idle)``, summed, divided by the number of
jobs: the pool's time if its work were spread evenly), the switch their ``timing_s/load_weights`` (the same
way; a version's row is written after the next version's load, so that load is taken out of its busy time),
update and publish the trainer's ``timing_s/update`` and ``timing_s/param_sync``. Everything is taken over
the steady window, from the end of the first update to the end of the last (start-up left out), which is
also what the measured time is; a rollout row is counted in the share of its wall time inside the window.
The ratio bound / measured is 1 for a run that overlaps perfectly; an on-policy run with generation twice
the update reaches about 2/3 (it does the two in sequence). Next to an on-policy run of the same task, a run's
speedup per update and its ceiling (the baseline's step over the run's bound per update) are given too.

Given the run's knobs (K, R, B) and its staleness log, the **budget-aware bound** is given next to it
(``budget_bound.py``): the admission budget lets the rollout run only ``s`` batches ahead of the version it
waits for, which adds a chain publish -> switch -> the groups that need the new version -> update. Both
bounds and both ratios are reported; neither replaces the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pandas as pd

from hpcrl.logs import metric_names as M
from hpcrl.analysis.budget_bound import BudgetChain


@dataclass
class Ceiling:
    """A run's measured steady time, its phase times over the same window, and the bound they imply."""

    updates: int
    """Updates in the window (all but the first)."""
    measured_s: float
    generation_s: float
    switch_s: float
    update_s: float
    publish_s: float
    tokens: int
    """Trained tokens in the window."""
    budget: Optional[BudgetChain] = None
    """The admission budget's chain (``budget_bound.py``); None without the knobs or the group times."""

    @property
    def bound_s(self) -> float:
        """max(generation + switch, update + publish): the best overlap could do (module docstring)."""
        return max(self.generation_s + self.switch_s, self.update_s + self.publish_s)

    @property
    def ratio(self) -> float:
        """bound / measured: 1.0 = the run overlaps as well as its phase times allow."""
        return self.bound_s / self.measured_s if self.measured_s > 0 else float("nan")

    @property
    def budget_bound_s(self) -> Optional[float]:
        """max(ideal-overlap bound, updates x the budget's least step time); None without the budget's chain."""
        return None if self.budget is None else max(self.bound_s, self.updates * self.budget.per_update_s)

    @property
    def budget_ratio(self) -> Optional[float]:
        """budget-aware bound / measured."""
        b = self.budget_bound_s
        return None if b is None or self.measured_s <= 0 else b / self.measured_s

    @property
    def limited_by(self) -> str:
        return "rollout" if self.generation_s + self.switch_s >= self.update_s + self.publish_s else "trainer"

    def line(self, time_scale: float = 1.0) -> str:
        """One sentence for the report (``time_scale``: a simulated run's modelled seconds per wall second)."""
        tput = self.tokens / self.measured_s if self.measured_s > 0 else float("nan")
        ceil = self.tokens / self.bound_s if self.bound_s > 0 else float("nan")
        scale = f" (wall seconds; x{time_scale:g} for the modelled GPU seconds)" if time_scale != 1.0 else ""
        return (f"over updates 2..{self.updates + 1}: measured {self.measured_s:.1f}s, {tput:.0f} trained tokens/s; "
                f"ideal overlap bound {self.bound_s:.1f}s ({ceil:.0f} tokens/s), limited by the {self.limited_by} "
                f"pool (generation {self.generation_s:.1f}s + weight switch {self.switch_s:.1f}s vs update "
                f"{self.update_s:.1f}s + publish {self.publish_s:.1f}s); measured / bound throughput "
                f"{self.ratio:.2f}{scale}" + self._budget_sentence())

    def _budget_sentence(self) -> str:
        if self.budget is None:
            return ""
        b = self.budget
        return (f". With the admission budget (B={b.B} groups per version, K={b.K}, R={b.R}) the step cannot beat "
                f"{b.per_update_s:.2f}s ({b.describe()}): budget-aware bound {self.budget_bound_s:.1f}s, measured / "
                f"bound throughput {self.budget_ratio:.2f}")


def _in_window(ro: pd.DataFrame, t0: float, t1: float) -> pd.Series:
    """Share of each rollout row's wall time [time_s - wall_s, time_s] inside [t0, t1]."""
    start = ro[M.TIME_S] - ro[M.WALL_S]
    inside = (ro[M.TIME_S].clip(upper=t1) - start.clip(lower=t0)).clip(lower=0)
    return inside / ro[M.WALL_S].where(ro[M.WALL_S] > 0, 1.0)


def _budget_chain(win: pd.DataFrame, switch_s: float, staleness: Optional[pd.DataFrame],
                  budget: Optional[tuple[int, int, int]]) -> Optional[BudgetChain]:
    """The budget's chain from the window's per-version times and the latencies of the groups it trained on."""
    if budget is None or staleness is None or staleness.empty:
        return None
    K, R, B = budget
    st = staleness[staleness["trainer_step"].isin(win[M.STEP])]  # names: M.STALENESS_COLUMNS
    groups = st.groupby("group_id")[["created_s", "finished_s"]].first()
    if groups.empty:
        return None
    versions = len(win) / K  # the trainer publishes and every job loads once per K updates
    return BudgetChain(K, R, B, publish_s=float(win[M.PARAM_SYNC_S].sum()) / versions, switch_s=switch_s / versions,
                       update_s=float(win[M.UPDATE_S].mean()),
                       group_latencies_s=list(groups["finished_s"] - groups["created_s"]))


def ceiling(metrics: pd.DataFrame, rollout: pd.DataFrame, rollout_jobs: Optional[int] = None,
            staleness: Optional[pd.DataFrame] = None, budget: Optional[tuple[int, int, int]] = None
            ) -> Optional[Ceiling]:
    """The ceiling of a run from its metrics and rollout logs; None with fewer than two updates. With its
    staleness log and ``budget = (K, R, B)`` the budget-aware bound too."""
    if len(metrics) < 2 or rollout.empty:
        return None
    m = metrics.sort_values(M.STEP)
    t0, t1 = float(m[M.TIME_S].iloc[0]), float(m[M.TIME_S].iloc[-1])
    win = m.iloc[1:]
    jobs = rollout_jobs or max(1, rollout[M.WRITER].nunique())
    ro = rollout.sort_values([M.WRITER, M.TIME_S])
    share = _in_window(ro, t0, t1)
    # a version's row is written once the next version is loaded: its wall time holds that load (not idle)
    next_load = ro.groupby(M.WRITER)[M.LOAD_WEIGHTS_S].shift(-1).fillna(0.0)
    busy = (ro[M.WALL_S] * (1 - ro[M.ROLLOUT_IDLE_RATIO]) - next_load).clip(lower=0)
    switch_s = float((next_load * share).sum()) / jobs
    return Ceiling(updates=len(win), measured_s=t1 - t0, generation_s=float((busy * share).sum()) / jobs,
                   switch_s=switch_s, update_s=float(win[M.UPDATE_S].sum()), publish_s=float(win[M.PARAM_SYNC_S].sum()),
                   tokens=int(win[M.N_TOKENS].sum()), budget=_budget_chain(win, switch_s, staleness, budget))


def run_ceiling(data) -> Optional[Ceiling]:
    """The ceiling of a loaded run (``analysis.load.RunData``); with its knobs known, the budget-aware bound too.
    KeyError for logs of an older hpcrl."""
    k = data.knobs
    budget = (k.trigger_parameter_sync_step, k.groups_per_update, k.admission_budget) if k else None
    return ceiling(data.metrics, data.rollout, k.rollout_jobs if k else None, data.staleness, budget)


def speedup_line(name: str, run: Ceiling, baseline_name: str, baseline: Ceiling) -> str:
    """A run's speedup over an on-policy baseline (per update) and the ceiling its own bound puts on it."""
    base_step = baseline.measured_s / baseline.updates
    budget = ("" if run.budget_bound_s is None else
              f", its budget-aware bound {base_step / (run.budget_bound_s / run.updates):.2f}x")
    return (f"{name}: {base_step / (run.measured_s / run.updates):.2f}x the step rate of {baseline_name} "
            f"(on-policy); its bound allows at most {base_step / (run.bound_s / run.updates):.2f}x{budget}")
