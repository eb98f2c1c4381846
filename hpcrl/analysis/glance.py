"""The report's first lines, in plain words: is it learning, how stale are the samples, which job waits, what to
change. ``hpcrl report`` prints them for each run and ``report.md`` opens with them; the numbers and the reasoning
behind them follow in the report (the recommendation of ``recommend.py``, the tables of ``tables.py``).

"Learning" compares the mean reward of the first and the last tenth of the updates (at least one update each,
:func:`hpcrl.analysis.tables.final_window`): a rise of more than :data:`NOISE` standard errors is learning, a fall as
large is not, anything between is "not clearly"; with the held-out score where the run has an evaluation job. The
noise of one update's mean reward is taken from the differences of successive updates (their spread / sqrt 2), which
a slow trend does not inflate.
"""
from __future__ import annotations

import math

import numpy as np

from hpcrl.logs import metric_names as M
from hpcrl.analysis import tables
from hpcrl.analysis.load import RunData
from hpcrl.analysis.recommend import Recommendation, recommend_run

NOISE = 2.0
"""A change of the mean reward larger than this many standard errors counts (about 95% for two normal means)."""
MIN_UPDATES = 4
"""Fewer updates than this are too early to tell."""

WHO_WAITS = {
    "rollout": "generation is the slow side",
    "trainer": "training is the slow side",
    "neither": "each waits for the other",
    "budget": "the admission budget holds generation back",
    "balanced": "both are busy",
    "unknown": "not known yet",
}
"""Each bottleneck of :class:`hpcrl.analysis.recommend.Recommendation`, in plain words."""


def learning(d: RunData) -> str:
    """``yes: reward 0.02 -> 0.41 ...`` (module docstring)."""
    m = d.metrics
    if m.empty or M.REWARD_MEAN not in m:
        return "not yet known: no update logged"
    rewards = m[M.REWARD_MEAN].astype(float).to_numpy()
    n = len(rewards)
    k = tables.final_window(n)
    first, last = rewards[:k], rewards[-k:]
    held = _held_out(d)
    if n < MIN_UPDATES:
        return f"too early to tell: {n} update(s), reward {rewards[-1]:.3g}{held}"
    if not np.any(rewards):
        return (f"no: every reward so far is 0 ({n} updates); see what the model writes (`hpcrl samples "
                f"{d.root}`) and whether the reward can score it (the dry run's warnings)")
    rise = float(last.mean() - first.mean())
    noise = float(np.std(np.diff(rewards), ddof=1)) / math.sqrt(2) if n > 2 else 0.0
    sem = noise * math.sqrt(2 / k)
    span = f"reward {first.mean():.3g} -> {last.mean():.3g} (mean of the first and the last {k} of {n} updates)"
    if rise > NOISE * sem and rise > 0:
        return f"yes: {span}{held}"
    if rise < -NOISE * sem and rise < 0:
        return f"no, the reward fell: {span}{held}"
    return f"not clearly: {span}, within the noise{held}"


def _held_out(d: RunData) -> str:
    ev = d.evals[d.evals["score"].notna()] if len(d.evals) and "score" in d.evals else d.evals.iloc[0:0]
    if ev.empty:
        return ""
    first, last = ev.iloc[0], ev.iloc[-1]
    if len(ev) == 1:
        return f"; held-out score {last['score']:.3g} (v{int(last['version'])})"
    return (f"; held-out score {first['score']:.3g} (v{int(first['version'])}) -> {last['score']:.3g} "
            f"(v{int(last['version'])})")


def staleness(d: RunData) -> str:
    """How old the trained samples were (a group's lag is its largest, as in the report's lag table), against what
    the knobs allow."""
    st = d.trained
    if st.empty or d.lacks("staleness", "group_id", "lag"):
        return "not yet known: no group trained" if st.empty else "not known: the staleness log lacks the lag"
    lag = st.groupby("group_id")["lag"].max()
    k = d.knobs
    allowed = "" if k is None else (f" (async_training.staleness_threshold={k.staleness_threshold:g} allows "
                                    f"{k.max_lag_bound} with one rollout job)")
    return (f"the samples trained on came from weights {lag.mean():.2f} versions old on average, at most "
            f"{int(lag.max())}{allowed}")


def waiting(d: RunData, rec: Recommendation) -> str:
    """Which job waits, and how much."""
    m, ro = d.metrics, d.rollout
    t = tables.trainer_idle(m) if not m.empty and not d.lacks("metrics", *tables.STEP_PARTS) else math.nan
    r = tables.rollout_idle(ro) if not ro.empty and not d.lacks("rollout", "wall_s", M.ROLLOUT_IDLE_RATIO) \
        else math.nan
    parts = []
    if not math.isnan(t):
        parts.append(f"the trainer waited for samples {t:.0%} of its time")
    if not math.isnan(r):
        parts.append(f"the rollout jobs waited for weights or the budget {r:.0%} of theirs")
    return (", ".join(parts) or "no wait logged yet") + f": {WHO_WAITS.get(rec.bottleneck, rec.bottleneck)}"


def glance(d: RunData) -> list[str]:
    """The four lines (module docstring), each ``what: answer``."""
    rec = recommend_run(d)
    return [f"learning: {learning(d)}", f"staleness: {staleness(d)}", f"waiting: {waiting(d, rec)}",
            f"to change: {rec.action or rec.line}"]
