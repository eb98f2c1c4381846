"""Held-out validation in the report: curves, the table of evaluated versions, best and last, examples.

From ``logs/eval.jsonl`` (:attr:`RunData.evals`, one row per evaluated version) and, for the examples,
``logs/eval_samples.jsonl.gz``. Curves plot verl's ``val-core`` metrics (``<key>/mean@N`` first, then ``best@N``
and ``maj@N``) against the trainer step of the version and against wall time (the version's publish time
since the run's first event), one line per data source; several runs are overlaid, one colour per run.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from hpcrl.analysis.load import RunData
from hpcrl.analysis.plots import empty_note, new_figure, save
from hpcrl.analysis.tables import best_and_last
from hpcrl.logs.eval_log import EVALUATED, SKIPPED, read_eval_samples, split_metric
from hpcrl.logs.metric_names import VAL_CORE
from hpcrl.rundir.paths import RunDir

MAX_PANELS = 4
"""Rows of the validation figure at most (one per kind of core metric)."""
STYLES = ["-", "--", ":", "-."]
"""Line style per data source in the overlaid figure."""
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def core_columns(ev: pd.DataFrame) -> dict[str, dict[str, str]]:
    """``{"<key>/<metric>": {data source: column}}`` of the ``val-core`` metrics (no ``/std``), ``mean@`` first."""
    out: dict[str, dict[str, str]] = {}
    for col in ev.columns:
        if not col.startswith(VAL_CORE + "/"):
            continue
        _, source, key, metric = split_metric(col)
        if not metric.endswith("/std"):
            out.setdefault(f"{key}/{metric}", {})[source] = col
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].split("/")[1].startswith("mean"), kv[0])))


def wall_s(d: RunData) -> pd.Series:
    """Each evaluated version's publish time since the run's first event."""
    ev = d.evals
    first = float(ev["published_s"][ev["published_s"] > 0].min()) if (ev["published_s"] > 0).any() else 0.0
    t0 = min(d.t0_s, first) if d.t0_s else first  # version 0 is published before the first logged group
    return ev["published_s"] - t0


def validation_table(d: RunData, rows: int = 25) -> pd.DataFrame:
    """One row per evaluated version (at most ``rows``: every k-th, the last always): its step, publish time, the
    headline score and each data source's core ``mean@N``."""
    ev = d.evals
    if ev.empty:
        return pd.DataFrame()
    keep = sorted(set(range(0, len(ev), max(1, math.ceil(len(ev) / rows)))) | {len(ev) - 1})
    cols = core_columns(ev)
    mean_cols = next(iter(cols.values()), {}) if cols else {}
    out = pd.DataFrame({"version": ev["version"], "trainer step": ev["trainer_step"],
                        "published (s)": wall_s(d).round(1), "score": ev["score"]})
    for source, col in mean_cols.items():
        out[f"{source} {next(iter(cols))}"] = ev[col]
    out["eval (s)"] = ev["eval_s"]
    return out.iloc[keep].reset_index(drop=True)


def skipped_versions(d: RunData) -> list[tuple[int, str, str]]:
    """(version, status, reason) of every due version the evaluation job did not evaluate."""
    return [(r.version, r.status, r.reason) for r in d.eval_rows if r.status != EVALUATED]


def examples(d: RunData, per_source: int = 3, width: int = 80) -> pd.DataFrame:
    """A few responses of the last evaluated version, per data source (prompt, response, reward)."""
    if d.evals.empty:
        return pd.DataFrame()
    version = int(d.evals["version"].iloc[-1])
    samples = read_eval_samples(RunDir(d.root).eval_samples, version)
    rows, seen = [], {}
    for s in samples:
        if seen.get(s.data_source, 0) < per_source:
            seen[s.data_source] = seen.get(s.data_source, 0) + 1
            rows.append({"version": version, "data source": s.data_source, "prompt": s.prompt[:width],
                         "response": s.response[:width], "ground truth": s.ground_truth[:width], "reward": s.reward})
    return pd.DataFrame(rows)


def _draw(ax_step, ax_wall, d: RunData, cols: dict[str, str], colour: Optional[str], who: str) -> None:
    x_wall = wall_s(d)
    for i, (source, col) in enumerate(sorted(cols.items())):
        ok = d.evals[col].notna()
        style = STYLES[i % len(STYLES)] if colour else "-"
        name = f"{who}: {source}" if who else source
        kw = {"color": colour} if colour else {}
        ax_step.plot(d.evals.loc[ok, "trainer_step"], d.evals.loc[ok, col], style, marker="o", ms=3, label=name, **kw)
        ax_wall.plot(x_wall[ok], d.evals.loc[ok, col], style, marker="o", ms=3, label=name, **kw)


def validation(d: RunData, out: Path) -> Path:
    """Each kind of core metric (rows) against trainer step and wall time (columns), one line per data source."""
    cols = core_columns(d.evals) if len(d.evals) else {}
    kinds = list(cols)[:MAX_PANELS] or ["(none)"]
    fig, ax = new_figure(12, 3.6 * len(kinds), ncols=2, nrows=len(kinds))
    for r, kind in enumerate(kinds):
        a, b = ax[r, 0], ax[r, 1]
        if kind in cols:
            _draw(a, b, d, cols[kind], None, "")
            a.legend(loc="best", fontsize=8)
        else:
            for x in (a, b):
                empty_note(x, "no evaluated version in logs/eval.jsonl")
        a.set_ylabel(f"val-core .../{kind}")
        a.set_xlabel("trainer step of the version")
        b.set_xlabel("wall time of the version's publish since the run's first event (s)")
    fig.suptitle(f"Validation on held-out prompts ({d.name}): one line per data source")
    return save(fig, out)


def compare_validation(runs: list[RunData], out: Path) -> Path:
    """The first core metric of each run, runs overlaid (colour per run, line style per data source)."""
    fig, ax = new_figure(12, 4.5, ncols=2)
    a, b = ax[0, 0], ax[0, 1]
    drawn = set()
    for i, d in enumerate(runs):
        cols = core_columns(d.evals) if len(d.evals) else {}
        if cols:
            kind = next(iter(cols))
            _draw(a, b, d, cols[kind], PALETTE[i % len(PALETTE)], d.name)
            drawn.add(kind)
    if not drawn:
        for x in (a, b):
            empty_note(x, "no run has an evaluated version")
    a.set_ylabel("val-core " + (" / ".join(sorted(drawn)) or "score"))
    a.set_xlabel("trainer step of the version")
    b.set_xlabel("wall time of the version's publish since the run's first event (s)")
    handles, labels = a.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", fontsize=9, ncols=min(len(handles), 3))
    fig.suptitle("Validation, runs overlaid")
    return save(fig, out)


def evaluation_line(d: RunData) -> str:
    """One sentence: how many versions were evaluated, skipped or damaged, best and last."""
    if d.evals.empty:
        if d.eval_enabled:
            return ("The config asks for an evaluation job (eval.every_versions > 0) but logs/eval.jsonl holds no "
                    "evaluated version (was the job started? see logs/jobs/eval.log).")
        return "No evaluation in this run (eval.every_versions = 0; `hpcrl eval RUN` evaluates versions afterwards)."
    bl = best_and_last(d)
    skipped = sum(r.status == SKIPPED for r in d.eval_rows)
    damaged = sum(r.status not in (EVALUATED, SKIPPED) for r in d.eval_rows)
    name = d.evals["score_name"].iloc[-1]
    s = (f"{len(d.evals)} versions evaluated ({int(d.evals['prompts'].iloc[-1])} prompts x {int(d.evals['n'].iloc[-1])}); "
         f"score = {name}: last {bl['val last']:.3f} (v{bl['val last v']}), best {bl['val best']:.3f} "
         f"(v{bl['val best v']})")
    if skipped or damaged:
        s += f"; {skipped} due versions skipped, {damaged} damaged (listed below)"
    return s + "."


def score_rise(d: RunData) -> tuple[float, float]:
    """(first, last) headline score: what the run's held-out score rose from and to."""
    ev = d.evals[d.evals["score"].notna()] if len(d.evals) else d.evals
    return (float(ev["score"].iloc[0]), float(ev["score"].iloc[-1])) if len(ev) else (np.nan, np.nan)
