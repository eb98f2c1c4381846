"""The numbers of the report, computed from :class:`~hpcrl.analysis.load.RunData`.

Each function returns a pandas DataFrame whose column names carry their unit,
and whose docstring says exactly how it is computed from the raw logs (the tests
recompute every table from the JSONL files by these definitions).

Conventions:
- a **group**'s lag is the largest lag of its trajectories (its oldest token);
  a trajectory's lag is ``trainer_version - version_start`` (the staleness log's
  ``lag``), so per-token lag is approximated by the trajectory's oldest token;
- a side's **idle ratio** over several rows is time-weighted: trainer
  ``sum(wait_samples) / sum(wait_samples + update + param_sync)``, rollout
  ``sum(idle_ratio * wall_s) / sum(wall_s)``;
- times are seconds; "version" is the weight version the side was using.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from hpcrl.logs import metric_names as M
from hpcrl.analysis.load import LOG_PATHS, RunData

STEP_PARTS = [M.WAIT_SAMPLES_S, M.UPDATE_S, M.PARAM_SYNC_S]


def step_seconds(m: pd.DataFrame) -> pd.Series:
    """Trainer seconds per local update: wait for samples + update + weight sync."""
    return m[STEP_PARTS].astype(float).sum(axis=1, skipna=False)  # a part missing = unknown, not 0


def trainer_idle(m: pd.DataFrame) -> float:
    total = step_seconds(m).sum(min_count=1)
    return float(m[M.WAIT_SAMPLES_S].astype(float).sum() / total) if total > 0 else math.nan


def rollout_idle(ro: pd.DataFrame) -> float:
    wall = ro["wall_s"].astype(float)
    return float((ro[M.ROLLOUT_IDLE_RATIO].astype(float) * wall).sum() / wall.sum()) if wall.sum() > 0 else math.nan


def taken_seconds(m: pd.DataFrame) -> pd.Series:
    """Unix time each update took its groups (end of its wait), indexed by step. The
    staleness log's ``consumed_s`` is stamped later, after the update and the publish."""
    return pd.Series((m["time_s"] - m[M.PARAM_SYNC_S] - m[M.UPDATE_S]).to_numpy(float),
                     index=m["step"].to_numpy())


def groups(data: RunData, trained_only: bool = True) -> pd.DataFrame:
    """One row per group of the staleness log (trained ones unless ``trained_only=False``),
    with ``taken_s`` (when the trainer took it, from the metrics row of its update; NaN
    if that row is missing)."""
    st = data.trained if trained_only else data.staleness
    if st.empty:
        return pd.DataFrame(columns=["group_id", "writer", "lag", "n_tokens", "trajectories", "version_start",
                                     "version_end", "trainer_version", "trainer_step", "reward", "created_s",
                                     "finished_s", "committed_s", "taken_s", "consumed_s", "dropped"])
    g = st.groupby("group_id", sort=False).agg(
        writer=("writer", "first"), version_start=("version_start", "min"), version_end=("version_end", "max"),
        trainer_version=("trainer_version", "first"), trainer_step=("trainer_step", "first"), lag=("lag", "max"),
        trajectories=("sample_id", "size"), n_tokens=("n_tokens", "sum"), reward=("reward", "mean"),
        created_s=("created_s", "first"), finished_s=("finished_s", "first"), committed_s=("committed_s", "first"),
        consumed_s=("consumed_s", "first"), dropped=("dropped", "first")).reset_index()
    taken = taken_seconds(data.metrics) if not data.metrics.empty and not data.lacks("metrics") else pd.Series(dtype=float)
    g["taken_s"] = g["trainer_step"].map(taken).astype(float)
    return g


def lag_table(data: RunData) -> pd.DataFrame:
    """Trained groups and tokens by lag (versions). Groups by their largest lag; tokens
    by their trajectory's lag."""
    g, st = groups(data), data.trained
    by_groups = g.groupby("lag").size()
    by_tokens = st.groupby("lag")["n_tokens"].sum()
    by_traj = st.groupby("lag").size()
    lags = sorted(set(by_groups.index) | set(by_tokens.index))
    out = pd.DataFrame({"lag (versions)": [int(x) for x in lags]})
    out["groups"] = [int(by_groups.get(x, 0)) for x in lags]
    out["% of groups"] = 100 * out["groups"] / max(out["groups"].sum(), 1)
    out["trajectories"] = [int(by_traj.get(x, 0)) for x in lags]
    out["tokens"] = [int(by_tokens.get(x, 0)) for x in lags]
    out["% of tokens"] = 100 * out["tokens"] / max(out["tokens"].sum(), 1)
    return out


def partial_table(data: RunData) -> pd.DataFrame:
    """Trained trajectories by partial span ``version_end - version_start`` (versions one
    trajectory's tokens span; 0 = generated under one version)."""
    st = data.trained
    span = (st["version_end"] - st["version_start"]).astype(int)
    out = st.assign(span=span).groupby("span").agg(trajectories=("sample_id", "size"), tokens=("n_tokens", "sum"))
    out = out.reset_index().rename(columns={"span": "span (versions)"})
    out["% of trajectories"] = 100 * out["trajectories"] / max(out["trajectories"].sum(), 1)
    return out[["span (versions)", "trajectories", "% of trajectories", "tokens"]]


def group_life_table(data: RunData) -> pd.DataFrame:
    """Seconds a trained group spent in each stage: generating (created -> finished),
    waiting to be committed in a shard (finished -> committed), queued until the
    trainer took it (committed -> taken, see :func:`taken_seconds`), in the update
    and weight publish (taken -> consumed), and in total (created -> consumed)."""
    g = groups(data)
    stages = {"generating": g["finished_s"] - g["created_s"], "waiting for commit": g["committed_s"] - g["finished_s"],
              "queued for the trainer": g["taken_s"] - g["committed_s"],
              "in the update and publish": g["consumed_s"] - g["taken_s"], "total": g["consumed_s"] - g["created_s"]}
    rows = [{"stage": k, "mean (s)": v.mean(), "p50 (s)": v.quantile(0.5), "p90 (s)": v.quantile(0.9),
             "max (s)": v.max()} for k, v in ((k, v.astype(float)) for k, v in stages.items())]
    return pd.DataFrame(rows)


def queue_depth(data: RunData) -> pd.Series:
    """Trained groups committed but not yet taken by the trainer, as a step function:
    index = unix time of each change, value = depth from then on."""
    g = groups(data).dropna(subset=["committed_s", "taken_s"])
    events = pd.concat([pd.Series(1, index=g["committed_s"].astype(float)),
                        pd.Series(-1, index=g["taken_s"].astype(float))])
    return events.groupby(level=0).sum().cumsum()  # a shard commits several groups at one time


def queue_depth_table(data: RunData) -> pd.DataFrame:
    """Share of the time between the first commit and the last take with k groups queued."""
    q = queue_depth(data)
    if len(q) < 2:
        return pd.DataFrame(columns=["queue depth (groups)", "% of time"])
    dt = np.diff(q.index.to_numpy(float))
    share = pd.Series(dt, index=q.to_numpy()[:-1]).groupby(level=0).sum()
    share = 100 * share / share.sum()
    return pd.DataFrame({"queue depth (groups)": share.index.astype(int), "% of time": share.to_numpy()})


def timing_table(data: RunData) -> pd.DataFrame:
    """Trainer seconds per local update by part, and rollout seconds per weight version."""
    m, ro = data.metrics, data.rollout
    parts = {}
    if not m.empty:
        parts.update({"trainer: wait for samples": m[M.WAIT_SAMPLES_S], "trainer: update": m[M.UPDATE_S],
                      "trainer: weight sync (publish)": m[M.PARAM_SYNC_S], "trainer: step (sum)": step_seconds(m)})
    if not ro.empty:
        parts.update({"rollout: wall per version": ro["wall_s"],
                      "rollout: load weights": ro[M.LOAD_WEIGHTS_S]})
    rows = [{"part": k, "count": int(len(v)), "mean (s)": v.astype(float).mean(), "p90 (s)": v.astype(float).quantile(0.9),
             "max (s)": v.astype(float).max(), "total (s)": v.astype(float).sum(min_count=1)} for k, v in parts.items()]
    return pd.DataFrame(rows)


def throughput_table(data: RunData) -> pd.DataFrame:
    """Tokens per second: trainer = trained tokens / its step seconds; each rollout
    writer = generated tokens / its wall seconds (rollout log)."""
    rows = []
    m = data.metrics
    if not m.empty:
        secs = float(step_seconds(m).sum(min_count=1))
        toks = int(m["n_tokens"].sum())
        rows.append({"side": "trainer", "tokens": toks, "seconds": secs, "tokens/s": toks / secs if secs > 0 else math.nan,
                     "groups": int(m["consumed_groups"].iloc[-1])})
    for w, r in data.rollout.groupby("writer"):
        secs, toks = float(r["wall_s"].sum()), int(r["tokens"].sum())
        rows.append({"side": f"rollout {w}", "tokens": toks, "seconds": secs,
                     "tokens/s": toks / secs if secs else math.nan, "groups": int(r["groups"].sum())})
    return pd.DataFrame(rows)


def version_bins(max_version: int, rows: int = 10) -> list[tuple[int, int]]:
    """At most ``rows`` contiguous inclusive ranges covering versions 0..max_version."""
    width = max(1, math.ceil((max_version + 1) / rows))
    return [(lo, min(lo + width - 1, max_version)) for lo in range(0, max_version + 1, width)]


def max_version(data: RunData) -> int:
    vals = [data.metrics["param_version"].max(), data.rollout["param_version"].max(),
            data.staleness["version_end"].max()]
    vals = [int(v) for v in vals if v is not None and not pd.isna(v)]
    return max(vals) if vals else 0


def version_table(data: RunData, rows: int = 10) -> pd.DataFrame:
    """Per range of weight versions: the trainer's updates and idle ratio while it held
    those versions, the rollout fleet's groups and idle ratio while it generated with
    them, the mean lag of the groups the trainer took then, and the mean reward of the
    trajectories those versions generated."""
    m, ro, st = data.metrics, data.rollout, data.trained
    g = groups(data)
    out = []
    for lo, hi in version_bins(max_version(data), rows):
        mi = m[m["param_version"].between(lo, hi)] if not m.empty else m
        ri = ro[ro["param_version"].between(lo, hi)] if not ro.empty else ro
        gi = g[g["trainer_version"].between(lo, hi)] if not g.empty else g
        si = st[st["version_start"].between(lo, hi)] if not st.empty else st
        out.append({"versions": f"v{lo}" if lo == hi else f"v{lo}-v{hi}", "updates": int(len(mi)),
                    "trainer idle": trainer_idle(mi) if len(mi) else math.nan,
                    "rollout groups": int(ri["groups"].sum()) if len(ri) else 0,
                    "rollout idle": rollout_idle(ri) if len(ri) else math.nan,
                    "lag mean (versions)": float(gi["lag"].mean()) if len(gi) else math.nan,
                    "reward of generated": float(si["reward"].mean()) if len(si) else math.nan})
    return pd.DataFrame(out)


def idle_per_version(data: RunData) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Trainer idle ratio per version held (time-weighted over its updates; with the
    seconds ``wait_s`` / ``step_s`` behind it) and rollout idle ratio per writer and
    version generated with (with ``idle_s`` / ``wall_s``)."""
    m = data.metrics
    tr = pd.DataFrame(columns=["param_version", "trainer idle", "wait_s", "step_s"])
    if not m.empty:
        per = m.assign(step_s=step_seconds(m), wait_s=m[M.WAIT_SAMPLES_S].astype(float))
        tr = per.groupby("param_version")[["wait_s", "step_s"]].sum().reset_index()
        tr["trainer idle"] = tr["wait_s"] / tr["step_s"]
    ro = pd.DataFrame(columns=["writer", "param_version", "rollout idle", "idle_s", "wall_s"])
    if not data.rollout.empty:
        r = data.rollout
        ro = pd.DataFrame({"writer": r["writer"], "param_version": r["param_version"],
                           "rollout idle": r[M.ROLLOUT_IDLE_RATIO].astype(float), "wall_s": r["wall_s"].astype(float)})
        ro["idle_s"] = ro["rollout idle"] * ro["wall_s"]
    return tr, ro


def rollout_count(data: RunData, column: str) -> int:
    """The sum over the rollout rows of a per-version count (0 for logs of an hpcrl without it)."""
    ro = data.rollout
    return int(ro[column].fillna(0).sum()) if column in ro else 0


def drops_table(data: RunData) -> pd.DataFrame:
    """Groups not trained on, by reason: rows of the staleness log with a non-empty
    ``dropped`` (``max_staleness``, ``lag_bound``), groups in damaged shards
    (``fully_async/count/corrupt_groups_skipped``, last metrics row; these never reach
    the staleness log), and the groups the rollout jobs' commit refused for the lag bound
    (``fully_async/lag_bound/dropped``: generated again; ``/carried``: continued, then trained)."""
    st = data.staleness
    d = st[st["dropped"].fillna("") != ""]
    rows = [{"reason": str(reason), "groups": int(r["group_id"].nunique()), "trajectories": int(len(r)),
             "source": f"{LOG_PATHS['staleness']} (dropped)"} for reason, r in d.groupby("dropped")]
    m = data.metrics
    corrupt = int(m[M.CORRUPT_GROUPS_SKIPPED].iloc[-1]) if not m.empty else 0
    if corrupt:
        rows.append({"reason": "corrupt shard", "groups": corrupt, "trajectories": None,
                     "source": "metrics fully_async/count/corrupt_groups_skipped"})
    for column, reason in ((M.LAG_DROPPED, "lag bound at commit: dropped, generated again"),
                           (M.LAG_CARRIED, "lag bound at commit: carried into a newer version (then trained)")):
        n = rollout_count(data, column)
        if n:
            rows.append({"reason": reason, "groups": n, "trajectories": None, "source": f"rollout rows {column}"})
    out = pd.DataFrame(rows, columns=["reason", "groups", "trajectories", "source"])
    return out.astype({"groups": "Int64", "trajectories": "Int64"})  # unknown trajectories stay n/a, not 32.000


def final_window(n_updates: int) -> int:
    """Updates averaged for "final reward": the last tenth of the run, at least one."""
    return max(1, round(n_updates / 10))


def best_and_last(d: RunData) -> dict:
    """The best and the last held-out score (``logs/eval.jsonl``'s headline) and their versions; NaN without any."""
    ev = d.evals[d.evals["score"].notna()] if len(d.evals) else d.evals
    if ev.empty:
        return {"val best": math.nan, "val best v": None, "val last": math.nan, "val last v": None}
    best = ev.loc[ev["score"].idxmax()]
    last = ev.iloc[-1]
    return {"val best": float(best["score"]), "val best v": int(best["version"]), "val last": float(last["score"]),
            "val last v": int(last["version"])}


def summary_row(data: RunData) -> dict:
    """One row of the side-by-side (ablation) table for this run; see REPORT_COLUMNS."""
    m, g, k = data.metrics, groups(data), data.knobs
    n = len(m)
    step = step_seconds(m) if n else pd.Series(dtype=float)
    synced = m[M.PARAM_SYNC_S][m[M.PARAM_SYNC_S] > 0] if n else pd.Series(dtype=float)
    total = float(m["time_s"].iloc[-1] - data.t0_s) if n else math.nan
    dropped = drops_table(data)["groups"].sum()
    return {
        "run": data.name,
        "s": f"{k.staleness_threshold:g}" if k else "n/a",
        "K": k.trigger_parameter_sync_step if k else math.nan,
        "R": k.groups_per_update if k else math.nan,
        "updates": n if not k else f"{n}/{k.total_updates}",
        "step (s)": float(step.mean()) if n else math.nan,
        "gen (s/group)": float((g["finished_s"] - g["created_s"]).mean()) if len(g) else math.nan,
        "update (s)": float(m[M.UPDATE_S].mean()) if n else math.nan,
        "sync (s)": float(synced.mean()) if len(synced) else math.nan,
        "total (s)": total,
        "final reward": float(m[M.REWARD_MEAN].iloc[-final_window(n):].mean()) if n else math.nan,
        "lag mean": float(g["lag"].mean()) if len(g) else math.nan,
        "lag max": int(g["lag"].max()) if len(g) else math.nan,
        "idle trainer": trainer_idle(m) if n else math.nan,
        "idle rollout": rollout_idle(data.rollout) if len(data.rollout) else math.nan,
        "tokens/s": float(m["n_tokens"].sum() / total) if n and total > 0 else math.nan,
        "peak GPU (GiB)": _peak(m, M.MAX_MEMORY_ALLOCATED_GB),
        "peak host (GiB)": _peak(m, M.CPU_MEMORY_USED_GB),
        "dropped groups": int(dropped),
        **{k: v for k, v in best_and_last(data).items() if not k.endswith(" v")},
    }


def _peak(m: pd.DataFrame, column: str) -> float:
    """The largest value of a memory column over the updates (NaN for a run that logged none)."""
    return float(m[column].max()) if len(m) and column in m else math.nan


COLUMN_DEFINITIONS = {
    "updates": "local updates logged / planned",
    "step (s)": "mean trainer seconds per local update (wait for samples + update + weight sync)",
    "gen (s/group)": "mean seconds from a group's start to its last response (created_s -> finished_s)",
    "update (s)": "mean `timing_s/update`",
    "peak GPU (GiB)": "largest `perf/max_memory_allocated_gb` of an update (trainer rank 0; 0 on a CPU)",
    "peak host (GiB)": "largest `perf/cpu_memory_used_gb` of an update: the trainer process's resident peak",
    "sync (s)": "mean `timing_s/param_sync` of the updates that published a version",
    "total (s)": "first event in the logs to the last update",
    "final reward": "mean `reward/mean` over the last tenth of the updates",
    "lag mean / lag max": "over trained groups, in versions",
    "idle trainer / idle rollout": "time-weighted idle ratios over the whole run",
    "tokens/s": "trained response tokens / total (s)",
    "val best / val last": "held-out score (logs/eval.jsonl: the mean over data sources of val-core/<source>/<key>/mean@N) "
                           "of the best and of the last evaluated version",
}


def ablation_table(runs: list[RunData]) -> pd.DataFrame:
    """The side-by-side table: one row per run."""
    return pd.DataFrame([summary_row(r) for r in runs])


def per_version_summary(st: pd.DataFrame) -> pd.DataFrame:
    """One row per trainer version from the staleness log: groups consumed, lag mean and max,
    mean reward (``hpcrl summary RUN_DIR``)."""
    if st.empty:
        return st
    groups = st.drop_duplicates("group_id")
    table = groups.groupby("trainer_version").agg(groups=("group_id", "count"), lag_mean=("lag", "mean"),
                                                  lag_max=("lag", "max"))
    table["reward_mean"] = st.groupby("trainer_version")["reward"].mean()
    return table
