"""PNG plots of one run. Each function draws one file and returns its path.

Figures are built with ``matplotlib.figure.Figure`` (Agg canvas, no pyplot
state, no display needed on a login node). Time axes are seconds since the
run's first logged event (``RunData.t0_s``); versions are weight versions.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from hpcrl.analysis import tables
from hpcrl.analysis.load import RunData
from hpcrl.logs import metric_names as M

COLORS = {"wait": "#bbbbbb", "update": "#1f77b4", "sync": "#ff7f0e", "generate": "#2ca02c", "load": "#d62728",
          "trainer": "#1f77b4", "rollout": "#2ca02c"}


WRITER_COLORS = ["#2ca02c", "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f"]


def writer_color(i: int) -> str:
    """Rollout writer i's colour (writer 0 in the rollout green)."""
    return WRITER_COLORS[i % len(WRITER_COLORS)]


def label(data: RunData) -> str:
    k = data.knobs
    return data.name if k is None else (f"{data.name} (s={k.staleness_threshold:g}, "
                                        f"K={k.trigger_parameter_sync_step}, R={k.groups_per_update})")


def rolling(values: pd.Series, n: int | None = None) -> pd.Series:
    """Centered rolling mean over about a twentieth of the points (at least 1)."""
    n = n or max(1, len(values) // 20)
    return values.rolling(n, center=True, min_periods=1).mean()


def rolling_ratio(num: pd.Series, den: pd.Series, n: int | None = None) -> np.ndarray:
    """Rolling time-weighted ratio sum(num)/sum(den) over about a tenth of the points, so
    the curve agrees with the whole-run (time-weighted) value."""
    n = n or max(1, len(num) // 10)
    num = pd.Series(np.asarray(num, float)).rolling(n, center=True, min_periods=1).sum()
    den = pd.Series(np.asarray(den, float)).rolling(n, center=True, min_periods=1).sum()
    return (num / den).to_numpy()


def new_figure(width_in: float = 10, height_in: float = 4.5, ncols: int = 1, nrows: int = 1):
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def empty_note(ax, text: str, x: float = 0.5, y: float = 0.5) -> None:
    """A message inside the axes (what is absent and why), boxed so it stays readable over data."""
    ax.text(x, y, text, ha="center", va="center", transform=ax.transAxes, fontsize=10,
            bbox=dict(boxstyle="round", facecolor="white", edgecolor="#999999"))


def lag_distribution(data: RunData, out: Path) -> Path:
    lt = tables.lag_table(data)
    fig, ax = new_figure(11, 4.2, ncols=2)
    bound = data.knobs.max_lag_bound if data.knobs else None
    for a, col, count, what in ((ax[0, 0], "% of groups", "groups", "trained groups (by their oldest token)"),
                                (ax[0, 1], "% of tokens", "tokens", "trained response tokens")):
        if lt.empty:
            empty_note(a, "no trained groups logged yet")
        else:
            bars = a.bar(lt["lag (versions)"], lt[col], color=COLORS["trainer"], width=0.6)
            a.bar_label(bars, labels=[f"{c:,}" for c in lt[count]], padding=2, fontsize=9)
            a.set_ylim(0, 110)
            top = max(int(lt["lag (versions)"].max()), bound or 0)
            a.set_xticks(range(0, top + 1))
            a.set_xlim(-0.6, top + 0.6)
            if bound is not None:
                a.axvline(bound + 0.4, color="k", ls="--", lw=1, label=f"admission bound: lag <= {bound}")
        a.set_xlabel("lag = trainer version at consumption - generating version (versions)")
        a.set_ylabel(f"% of {what.split(' (')[0]}")
        a.set_title(f"{what}; numbers on bars = {count}", fontsize=10)
    handles, labels = ax[0, 0].get_legend_handles_labels()
    if handles:  # below the axes: at s=0 the one bar reaches the top, where an inner legend would sit on it
        fig.legend(handles, labels, loc="outside lower center", fontsize=9)
    fig.suptitle(f"Lag distribution - {label(data)}")
    return save(fig, out)


def lag_over_time(data: RunData, out: Path) -> Path:
    g = tables.groups(data)
    fig, ax = new_figure()
    a = ax[0, 0]
    if g.empty:
        empty_note(a, "no trained groups logged yet")
    else:
        per = g.groupby("trainer_step").agg(t=("consumed_s", "first"), mean=("lag", "mean"), max=("lag", "max"))
        t = per["t"] - data.t0_s
        a.plot(t, per["max"], drawstyle="steps-post", color="#d62728", lw=1, label="max lag of the update's groups")
        a.plot(t, per["mean"], color=COLORS["trainer"], lw=1, alpha=0.5, label="mean lag of the update's groups")
        a.plot(t, rolling(per["mean"]), color=COLORS["trainer"], lw=2.5, label="mean lag, rolling mean")
        if data.knobs:
            a.axhline(data.knobs.max_lag_bound, color="#888888", ls="--", lw=3, zorder=0,
                      label=f"admission bound: lag <= {data.knobs.max_lag_bound}")
        top = int(max(float(per["max"].max()), data.knobs.max_lag_bound if data.knobs else 0)) + 1
        a.set_ylim(-0.3, top + 0.3)
        a.set_yticks(range(0, top + 1))  # lags are whole versions
        a.legend(loc="upper left", fontsize=9)
        if per["max"].max() == 0:
            empty_note(a, "every trained group had lag 0 (generated by the version the trainer held)", y=0.45)
    a.set_xlabel("wall time since the run's first event (s); one point per trainer update")
    a.set_ylabel("lag (versions)")
    fig.suptitle(f"Lag of the groups each update trained on - {label(data)}")
    return save(fig, out)


def partial_spans(data: RunData, out: Path) -> Path:
    pt = tables.partial_table(data)
    fig, ax = new_figure(8, 4)
    a = ax[0, 0]
    if pt.empty:
        empty_note(a, "no trained trajectories logged yet")
    else:
        bars = a.bar(pt["span (versions)"], pt["% of trajectories"], color=COLORS["generate"], width=0.6)
        a.bar_label(bars, labels=[f"{c:,}" for c in pt["trajectories"]], padding=2, fontsize=9)
        a.set_xticks(range(0, int(pt["span (versions)"].max()) + 2))
        a.set_ylim(0, 110)
        if (pt["span (versions)"] == 0).all():
            on = data.knobs.partial_rollout if data.knobs else False
            empty_note(a, f"No partial rollouts:\nall {int(pt['trajectories'].sum()):,} trajectories were generated\n"
                          f"under one weight version\n(partial_rollout={str(on).lower()})", x=0.75, y=0.6)
    a.set_xlabel("partial span = version_end - version_start of a trajectory (versions)")
    a.set_ylabel("% of trained trajectories")
    fig.suptitle(f"Partial rollout spans - {label(data)}")
    return save(fig, out)


def idle_ratios(data: RunData, out: Path) -> Path:
    tr, ro = tables.idle_per_version(data)
    fig, ax = new_figure(10, 5.2)
    a = ax[0, 0]
    if not tr.empty:
        a.plot(tr["param_version"], tr["trainer idle"], color=COLORS["trainer"], lw=0.8, alpha=0.4)
        a.plot(tr["param_version"], rolling_ratio(tr["wait_s"], tr["step_s"]), color=COLORS["trainer"], lw=2.5,
               label="trainer: share of time waiting for samples")
        whole = tables.trainer_idle(data.metrics)
        a.axhline(whole, color=COLORS["trainer"], ls=":", lw=1.5, label=f"trainer, whole run: {whole:.2f}")
    if not ro.empty:
        for i, (w, r) in enumerate(ro.groupby("writer")):
            a.plot(r["param_version"], r["rollout idle"], color=writer_color(i), lw=0.8, alpha=0.4)
            a.plot(r["param_version"], rolling_ratio(r["idle_s"], r["wall_s"]), color=writer_color(i), lw=2.5,
                   label=f"rollout {w}: share of time with nothing in flight")
        whole = tables.rollout_idle(data.rollout)
        a.axhline(whole, color=COLORS["rollout"], ls=":", lw=1.5, label=f"rollout, whole run: {whole:.2f}")
    if tr.empty and ro.empty:
        empty_note(a, "no metrics logged yet")
    a.set_ylim(0, 1.05)
    a.set_xlabel("weight version the side was using")
    a.set_ylabel("idle ratio (0 = always busy)")
    if not (tr.empty and ro.empty):
        fig.legend(loc="outside lower center", fontsize=9, ncols=2)  # below the axes: the curves span 0..1
    fig.suptitle(f"Idle ratio per weight version - {label(data)}\n"
                 "(thin: per version; thick: rolling, time-weighted like the whole-run value)", fontsize=11)
    return save(fig, out)


def _timeline_lanes(data: RunData) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(lane name, colour key, [(start_s, duration_s)]) for the timeline, from the logs."""
    lanes = []
    m, t0 = data.metrics, data.t0_s
    if not m.empty:
        end = m["time_s"].astype(float) - t0
        sync = m[M.PARAM_SYNC_S].astype(float)
        upd = m[M.UPDATE_S].astype(float)
        wait = m[M.WAIT_SAMPLES_S].astype(float)
        lanes.append(("trainer: weight sync", "sync", list(zip(end - sync, sync))))
        lanes.append(("trainer: update", "update", list(zip(end - sync - upd, upd))))
        lanes.append(("trainer: wait for samples", "wait", list(zip(end - sync - upd - wait, wait))))
    g = tables.groups(data)
    ro = data.rollout
    writers = sorted(set(g["writer"]) | set(ro["writer"] if not ro.empty else []))
    for w in writers:
        if not ro.empty:
            r = ro[ro["writer"] == w]
            start = r["time_s"].astype(float) - r["wall_s"].astype(float) - t0
            load = r[M.LOAD_WEIGHTS_S].astype(float)
            lanes.append((f"rollout {w}: load weights", "load", list(zip(start - load, load))))
        gw = g[g["writer"] == w]
        lanes.append((f"rollout {w}: groups generating", "generate",
                      list(zip(gw["created_s"] - t0, gw["finished_s"] - gw["created_s"]))))
    return lanes


def timeline(data: RunData, out: Path, zoom_versions: int = 5) -> Path:
    lanes = _timeline_lanes(data)
    fig, ax = new_figure(12, 7, nrows=2)
    m = data.metrics
    publish = (m["time_s"].astype(float) - data.t0_s)[m[M.PARAM_SYNC_S] > 0] if not m.empty else pd.Series()
    published = (m["param_version"] + 1)[m[M.PARAM_SYNC_S] > 0] if not m.empty else pd.Series()
    zoom = middle_window(data, zoom_versions)
    lanes = [(name, colour, [(s, d) for s, d in spans if np.isfinite(s) and np.isfinite(d) and d > 0])
             for name, colour, spans in lanes]
    for a, window in ((ax[0, 0], None), (ax[1, 0], zoom)):
        lo_hi = window or (min((s for _, _, sp in lanes for s, _ in sp), default=0.0),
                           max((s + d for _, _, sp in lanes for s, d in sp), default=1.0))
        min_width = (lo_hi[1] - lo_hi[0]) / 1000  # about one pixel: short events stay visible
        for y, (name, colour, spans) in enumerate(lanes):
            a.broken_barh([(s, max(d, min_width)) for s, d in spans], (y - 0.35, 0.7), facecolors=COLORS[colour],
                          alpha=0.9 if colour != "generate" else 0.5)
        a.set_yticks(range(len(lanes)), [name + ("" if spans else " (not in the logs)") for name, _, spans in lanes],
                     fontsize=9)
        a.set_ylim(-0.7, len(lanes) + (0.2 if window else -0.3))
        a.set_xlabel("wall time since the run's first event (s)")
        a.grid(axis="x", alpha=0.3)
        if window is not None:
            a.set_xlim(*window)
            for t, v in zip(publish, published):
                if window[0] <= t <= window[1]:
                    a.axvline(t, color="k", lw=0.6, ls=":")
                    a.text(t, len(lanes) - 0.4, f"v{int(v)}", fontsize=8, ha="center", va="bottom")
    ax[0, 0].set_title("whole run" + ("" if zoom is None else " (the shaded window is enlarged below)"), fontsize=10)
    if zoom is not None:
        ax[0, 0].axvspan(*zoom, color="y", alpha=0.25)
        ax[1, 0].set_title(f"{window_versions(data, zoom)} in the middle of the run; dotted lines: version "
                           "published (label = new version)", fontsize=10)
    else:
        ax[1, 0].set_visible(False)
    if not lanes:
        empty_note(ax[0, 0], "no timings logged yet")
    fig.suptitle(f"Timeline of generation, training and weight sync - {label(data)}\n"
                 "(white between trainer bars: checkpoints and logging; events shorter than a pixel are drawn one "
                 "pixel wide)", fontsize=11)
    return save(fig, out)


def middle_window(data: RunData, versions: int = 5) -> tuple[float, float] | None:
    """Seconds since t0 spanning ``versions`` publishes in the middle of the run (for zooms)."""
    m = data.metrics
    if m.empty:
        return None
    publish = (m["time_s"].astype(float) - data.t0_s)[m[M.PARAM_SYNC_S] > 0]
    if len(publish) < versions + 1:
        return None
    first = (len(publish) - versions - 1) // 2
    lo, hi = float(publish.iloc[first]), float(publish.iloc[first + versions])
    pad = 0.15 * (hi - lo)
    return lo - pad, hi + pad


def window_versions(data: RunData, window: tuple[float, float]) -> str:
    """``7 weight versions published (v12-v18)``: the publishes that fall in ``window`` (what a zoom shows: the
    versions :func:`middle_window` spans and those its margins catch)."""
    m = data.metrics
    t = m["time_s"].astype(float) - data.t0_s
    shown = (m["param_version"] + 1)[(m[M.PARAM_SYNC_S] > 0) & (t >= window[0]) & (t <= window[1])]
    if shown.empty:
        return "no weight version published"
    return f"{len(shown)} weight versions published (v{int(shown.min())}-v{int(shown.max())})"


def throughput(data: RunData, out: Path) -> Path:
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[2, 1])
    a, b, c = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    m, ro, t0 = data.metrics, data.rollout, data.t0_s
    if not m.empty:
        t = m["time_s"] - t0
        a.plot(t, m[M.TOKENS_PER_S], color=COLORS["trainer"], lw=0.7, alpha=0.35)
        a.plot(t, rolling(m[M.TOKENS_PER_S]), color=COLORS["trainer"], lw=2.5,
               label="trainer: tokens trained / step seconds (per update)")
    if not ro.empty:
        for i, (w, r) in enumerate(ro.groupby("writer")):
            t = r["time_s"] - t0
            a.plot(t, r[M.TOKENS_PER_S], color=writer_color(i), lw=0.7, alpha=0.35)
            a.plot(t, rolling(r[M.TOKENS_PER_S].reset_index(drop=True)).to_numpy(), color=writer_color(i),
                   lw=2.5, label=f"rollout {w}: tokens generated / wall seconds (per version)")
    if m.empty and ro.empty:
        empty_note(a, "no metrics logged yet")
    else:
        a.set_ylim(0, a.get_ylim()[1] * 1.3)  # headroom for the legend above the curves
        a.legend(loc="upper left", fontsize=8, ncols=2)
    a.set_xlabel("wall time since the run's first event (s)")
    a.set_ylabel("response tokens / s")
    a.set_title("Throughput (thin: raw, thick: rolling mean)", fontsize=10)
    q = tables.queue_depth(data)
    window = middle_window(data)
    if len(q) >= 2:
        b.step(q.index - t0, q.to_numpy(), where="post", color="#9467bd", lw=1.5, label="groups committed, not yet taken")
        if data.knobs:
            b.axhline(data.knobs.admission_budget, color="#888888", ls="--", lw=2, zorder=0,
                      label=f"admission budget B = {data.knobs.admission_budget}")
            b.axhline(data.knobs.groups_per_update, color=COLORS["trainer"], ls=":", lw=2, zorder=0,
                      label=f"groups per update R = {data.knobs.groups_per_update}")
        if window:
            b.set_xlim(*window)
        b.set_ylim(0, max(float(q.max()), data.knobs.admission_budget if data.knobs else 0) + 1.5)
        b.legend(loc="upper right", fontsize=8, ncols=3)
        qt = tables.queue_depth_table(data)
        c.bar(qt["queue depth (groups)"], qt["% of time"], color="#9467bd")
        c.set_xticks(qt["queue depth (groups)"])
    else:
        empty_note(b, "no trained groups logged yet")
    b.set_xlabel("wall time since the run's first event (s)")
    b.set_ylabel("queue depth (groups)")
    b.set_title("Queue between rollout and trainer" + (f", {window_versions(data, window)} in the middle of the run"
                                                       if window else ""), fontsize=10)
    c.set_xlabel("queue depth (groups)")
    c.set_ylabel("% of time")
    c.set_title("Queue depth, whole run", fontsize=10)
    fig.suptitle(f"Throughput and queue - {label(data)}")
    return save(fig, out)


def reward(data: RunData, out: Path) -> Path:
    fig, ax = new_figure(12, 4.5, ncols=2)
    a, b = ax[0, 0], ax[0, 1]
    st = data.trained
    if not st.empty:
        per = st.groupby("version_start")["reward"].mean()
        a.plot(per.index, per.values, "o", ms=3, color=COLORS["rollout"], alpha=0.5, label="per version")
        a.plot(per.index, rolling(per).values, color=COLORS["rollout"], lw=2.5, label="rolling mean")
        a.legend(loc="upper left", fontsize=9)
    else:
        empty_note(a, "no trained trajectories logged yet")
    a.set_xlabel("weight version that generated the trajectory (version_start)")
    a.set_ylabel("mean reward of its trained trajectories")
    a.set_title("Reward against policy version", fontsize=10)
    m = data.metrics
    if not m.empty:
        t = m["time_s"] - data.t0_s
        b.plot(t, m[M.REWARD_MEAN], color=COLORS["trainer"], lw=0.7, alpha=0.4, label="per update (reward/mean)")
        b.plot(t, rolling(m[M.REWARD_MEAN]), color=COLORS["trainer"], lw=2.5, label="rolling mean")
        b.legend(loc="upper left", fontsize=9)
    else:
        empty_note(b, "no metrics logged yet")
    b.set_xlabel("wall time since the run's first event (s)")
    b.set_ylabel("mean reward of the update's batch")
    b.set_title("Reward against wall time", fontsize=10)
    fig.suptitle(f"Reward - {label(data)}")
    return save(fig, out)


def _rollout_by_step(data: RunData, steps) -> dict:
    """Cumulative rollout-side counts (:data:`M.LAG_DROPPED`, :data:`M.LAG_CARRIED`) at each trainer step: a
    version's count is placed at the first step that trained from that version."""
    ro, m = data.rollout, data.metrics
    out = {}
    for column in (M.LAG_DROPPED, M.LAG_CARRIED):
        if column not in ro or ro.empty:
            continue
        per_version = ro.groupby("param_version")[column].sum()
        first_step = m.groupby(M.PARAM_VERSION)["step"].min()
        at = per_version.rename(index=lambda v: first_step.get(v, steps.max())).groupby(level=0).sum()
        out[column] = at.reindex(steps, fill_value=0).cumsum().to_numpy()
    return out


def drops(data: RunData, out: Path) -> Path:
    fig, ax = new_figure(10, 4)
    a = ax[0, 0]
    st, m = data.staleness, data.metrics
    d = st[st["dropped"].fillna("") != ""]
    if m.empty:
        empty_note(a, "no metrics logged yet")
    else:
        steps = m["step"].to_numpy()
        reasons = {"max_staleness": d[d["dropped"] == "max_staleness"]}
        reasons.update({str(r): rows for r, rows in d.groupby("dropped") if r != "max_staleness"})
        for reason, r in reasons.items():
            per_step = r.drop_duplicates("group_id").groupby("trainer_step").size()
            a.step(steps, per_step.reindex(steps, fill_value=0).cumsum(), where="post", lw=2,
                   label=f"{reason} (staleness log, column dropped)")
        corrupt = m[M.CORRUPT_GROUPS_SKIPPED].astype(float)
        a.step(steps, corrupt, where="post", lw=2, ls="--", color=COLORS["load"],
               label="corrupt shard (metrics fully_async/count/corrupt_groups_skipped)")
        at_commit = _rollout_by_step(data, steps)
        for column, what in ((M.LAG_DROPPED, "lag bound at commit: dropped, generated again"),
                             (M.LAG_CARRIED, "lag bound at commit: carried into a newer version")):
            if at_commit.get(column) is not None and at_commit[column][-1] > 0:
                a.step(steps, at_commit[column], where="post", lw=2, ls=":", label=f"{what} (rollout {column})")
        a.legend(loc="upper left", fontsize=9)
        a.set_ylim(bottom=-0.05 * max(1.0, a.get_ylim()[1]), top=max(1.0, a.get_ylim()[1]))
        if d.empty and corrupt.iloc[-1] == 0 and not any(v[-1] > 0 for v in at_commit.values()):
            ms = data.knobs.max_staleness if data.knobs else None
            empty_note(a, "No samples were dropped: no group exceeded async_training.max_staleness "
                          f"({'off' if ms is None else ms}) or the lag bound,\nnone lacked spread "
                          "(algorithm.filter_groups) and no shard was damaged.")
    a.set_xlabel("trainer update (step)")
    a.set_ylabel("groups dropped (cumulative)")
    fig.suptitle(f"Samples dropped and why - {label(data)}")
    return save(fig, out)


PLOTS = {
    "lag_distribution.png": lag_distribution,
    "lag_over_time.png": lag_over_time,
    "partial_spans.png": partial_spans,
    "idle_ratios.png": idle_ratios,
    "timeline.png": timeline,
    "throughput.png": throughput,
    "reward.png": reward,
    "drops.png": drops,
}
