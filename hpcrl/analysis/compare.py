"""Overlaid curves of several runs (the side-by-side part of the report).

One colour per run, the same in every figure; the legend label carries the
knobs that usually differ between the runs of an ablation (s, K, R).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcrl.analysis import tables
from hpcrl.analysis.load import RunData
from hpcrl.analysis.plots import empty_note, label, new_figure, rolling, rolling_ratio, save
from hpcrl.logs import metric_names as M

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def reward(runs: list[RunData], out: Path) -> Path:
    fig, ax = new_figure(12, 4.5, ncols=2)
    a, b = ax[0, 0], ax[0, 1]
    for i, d in enumerate(runs):
        m = d.metrics
        if m.empty:
            continue
        a.plot(m["time_s"] - d.t0_s, rolling(m[M.REWARD_MEAN]), color=_colour(i), lw=2, label=label(d))
        b.plot(m["step"], rolling(m[M.REWARD_MEAN]), color=_colour(i), lw=2, label=label(d))
    a.set_xlabel("wall time since the run's first event (s)")
    b.set_xlabel("trainer update (step)")
    for x in (a, b):
        x.set_ylabel("mean reward per update (rolling mean)")
    handles, labels = b.get_legend_handles_labels()
    if handles:  # below the axes: rising reward curves fill the upper left, where the legend used to be
        fig.legend(handles, labels, loc="outside lower center", fontsize=9, ncols=min(len(handles), 3))
    a.set_title("against wall time", fontsize=10)
    b.set_title("against updates", fontsize=10)
    fig.suptitle("Reward, runs overlaid")
    return save(fig, out)


def lag(runs: list[RunData], out: Path) -> Path:
    fig, ax = new_figure(10, 4.5)
    a = ax[0, 0]
    width = 0.8 / max(len(runs), 1)
    top = 0
    for i, d in enumerate(runs):
        lt = tables.lag_table(d)
        if lt.empty:
            continue
        x = lt["lag (versions)"].to_numpy() - 0.4 + width * (i + 0.5)
        bars = a.bar(x, lt["% of groups"], width=width * 0.95, color=_colour(i), label=label(d))
        a.bar_label(bars, labels=[f"{v:.0f}%" for v in lt["% of groups"]], fontsize=8, padding=2)
        top = max(top, int(lt["lag (versions)"].max()))
    a.set_xticks(range(0, top + 1))
    a.set_ylim(0, 110)
    a.set_xlabel("lag (versions)")
    a.set_ylabel("% of trained groups")
    a.legend(loc="upper right", fontsize=9)
    fig.suptitle("Lag distribution, runs side by side")
    return save(fig, out)


def idle(runs: list[RunData], out: Path) -> Path:
    fig, ax = new_figure(12, 4.5, ncols=2)
    a, b = ax[0, 0], ax[0, 1]
    for i, d in enumerate(runs):
        tr, ro = tables.idle_per_version(d)
        if not tr.empty:
            a.plot(tr["param_version"], rolling_ratio(tr["wait_s"], tr["step_s"]), color=_colour(i), lw=2,
                   label=f"{label(d)}: {tables.trainer_idle(d.metrics):.2f} whole run")
        if not ro.empty:
            per = ro.groupby("param_version")[["idle_s", "wall_s"]].sum()  # all writers together
            b.plot(per.index, rolling_ratio(per["idle_s"], per["wall_s"]), color=_colour(i), lw=2,
                   label=f"{label(d)}: {tables.rollout_idle(d.rollout):.2f} whole run")
    for x, side in ((a, "trainer idle ratio (waiting for samples)"),
                    (b, "rollout idle ratio (nothing in flight)")):
        x.set_ylim(0, 1.05)
        x.set_xlabel("weight version the side was using")
        x.set_ylabel(side)
        x.legend(loc="lower left", fontsize=9)
    a.set_title("trainer", fontsize=10)
    b.set_title("rollout, all writers together", fontsize=10)
    fig.suptitle("Idle ratios, runs overlaid (rolling over a tenth of the versions, time-weighted)")
    return save(fig, out)


def progress(runs: list[RunData], out: Path) -> Path:
    fig, ax = new_figure(10, 4.5)
    a = ax[0, 0]
    drawn = False
    for i, d in enumerate(runs):
        m = d.metrics
        if m.empty:
            continue
        t = np.concatenate([[0.0], (m["time_s"] - d.t0_s).to_numpy(float)])
        groups = np.concatenate([[0], m["consumed_groups"].to_numpy(float)])
        a.plot(t, groups, color=_colour(i), lw=2, label=f"{label(d)}: {tables.summary_row(d)['total (s)']:.1f} s")
        drawn = True
    if not drawn:
        empty_note(a, "no metrics logged yet")
    a.set_xlabel("wall time since the run's first event (s)")
    a.set_ylabel("groups consumed by the trainer (cumulative)")
    a.legend(loc="upper left", fontsize=9)
    fig.suptitle("Progress, runs overlaid (steeper = faster; legend: time to the last update)")
    return save(fig, out)


COMPARE_PLOTS = {
    "compare_reward.png": reward,
    "compare_lag.png": lag,
    "compare_idle.png": idle,
    "compare_progress.png": progress,
}
