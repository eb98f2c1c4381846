"""Read one run directory for analysis: tolerant of runs in progress, crashed jobs,
torn last rows and runs written by older hpcrl versions.

Everything comes from files the jobs already write (docs/analysis.md, "Logs"):

==============================  ==============================================
file                            used for
==============================  ==============================================
logs/staleness.jsonl.gz         lag, partial spans, group life times, reward per
                                generating version, drops (column ``dropped``)
logs/metrics.jsonl              trainer timings (wait/update/sync), idle ratio,
                                throughput, reward over time, drop counters
logs/rollout-<writer>.jsonl     rollout idle ratio, load time, throughput per version
logs/eval.jsonl                 validation curves and scores (the evaluation job, ``hpcrl eval``)
logs/eval_samples.jsonl.gz      example responses of the last evaluated version
control/heartbeat/*.json        job states (status view, "crashed?" notes)
control/trainer_done.json       the run finished
config.yaml                     the knobs (s, K, R, B) and the lag bound
==============================  ==============================================

Nothing here raises on a damaged or partial run except :class:`RunFormatError`
(not a run directory, or nothing to analyse); everything else becomes a *note*
that the report prints, and columns an older hpcrl did not write are listed in
``RunData.missing`` so the sections that need them say so instead of failing.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import yaml

from hpcrl.config import ConfigError, RunConfig, config_from_dict
from hpcrl.config.knobs import Knobs
from hpcrl.control.fatal import read_fatal
from hpcrl.control.records import Heartbeat, TrainerDone, read_heartbeats, read_trainer_done
from hpcrl.logs.eval_log import EVALUATED, JOB, read_eval_rows
from hpcrl.logs.run_logs import read_jsonl_frame
from hpcrl.logs.metric_names import STALENESS_COLUMNS
from hpcrl.rundir.paths import RunDir
from hpcrl.logs import metric_names as M

log = logging.getLogger(__name__)

# Columns each log must have for the full report (hpcrl/logs/metric_names.py). A run written by an
# older hpcrl may lack some: the sections that need them are skipped with a message naming them.
METRICS_COLUMNS = list(M.METRICS_COLUMNS)
ROLLOUT_COLUMNS = list(M.ROLLOUT_COLUMNS)
# Counters that exist only once something was counted: 0 when absent.
COUNTERS = list(M.COUNTERS)
REQUIRED = {"staleness": STALENESS_COLUMNS, "metrics": METRICS_COLUMNS, "rollout": ROLLOUT_COLUMNS}


class RunFormatError(ValueError):
    """The folder is not an hpcrl run directory, or holds nothing to analyse yet."""


@dataclass
class RunData:
    """Everything the report and status read from one run directory, as frames and notes."""

    name: str
    root: Path
    knobs: Optional[Knobs]
    staleness: pd.DataFrame
    """One row per consumed (or dropped) trajectory."""
    metrics: pd.DataFrame
    """One row per local update."""
    rollout: pd.DataFrame
    """One row per rollout writer and weight version."""
    heartbeats: dict[str, Heartbeat]
    trainer_done: Optional[TrainerDone]
    t0_s: float
    """Unix time taken as 0 on every time axis: the earliest event in the logs."""
    notes: list[str] = field(default_factory=list)
    """What a reader of the report must know (torn lines skipped, run unfinished, ...)."""
    missing: dict[str, list[str]] = field(default_factory=dict)
    """Log name -> required columns it lacks (an older hpcrl wrote it)."""
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per evaluated version (``logs/eval.jsonl``: the evaluation job's rows, else ``hpcrl eval``'s),
    by version; its metrics are columns (``val-core/...``)."""
    eval_rows: list = field(default_factory=list)
    """Every row of ``logs/eval.jsonl`` (:class:`hpcrl.logs.eval_log.EvalRow`), skipped and damaged included."""
    eval_enabled: bool = False
    """The config asks for an evaluation job."""

    @property
    def finished(self) -> bool:
        return self.trainer_done is not None

    @property
    def trained(self) -> pd.DataFrame:
        """Staleness rows of trajectories that were trained on (not dropped)."""
        st = self.staleness
        return st[st["dropped"].fillna("") == ""] if "dropped" in st else st

    def lacks(self, log_name: str, *columns: str) -> list[str]:
        """The given columns (all required ones if none given) that ``log_name`` lacks."""
        want = columns or REQUIRED[log_name]
        return [c for c in want if c in self.missing.get(log_name, [])]

    def unavailable(self, what: str, partial: bool = False, **needs: list[str]) -> Optional[str]:
        """A sentence saying why ``what`` cannot be shown (``partial``: only in part), or None
        if every needed column is there."""
        gaps = []
        for log_name, cols in needs.items():
            frame = {"staleness": self.staleness, "metrics": self.metrics, "rollout": self.rollout}[log_name]
            if frame.empty:
                gaps.append(f"{LOG_PATHS[log_name]} has no rows yet")
            elif self.lacks(log_name, *cols):
                gaps.append(f"{LOG_PATHS[log_name]} lacks {', '.join(self.lacks(log_name, *cols))}")
        if not gaps:
            return None
        if partial:
            return f"{what}: incomplete ({'; '.join(gaps)}); what the logs do have is shown."
        return f"{what}: not available ({'; '.join(gaps)})."


def _log_paths() -> dict[str, str]:
    """Each log's path relative to a run's root, for messages (``logs/metrics.jsonl``, ...)."""
    rd = RunDir("/run")
    return {name: str(path.relative_to(rd.root)) for name, path in
            (("staleness", rd.staleness), ("metrics", rd.metrics), ("rollout", rd.rollout_metrics("*")))}


LOG_PATHS = _log_paths()


def _read_log(path: Path, notes: list[str], root: Path) -> pd.DataFrame:
    bad: list[int] = []
    frame = read_jsonl_frame(path, on_bad_line=lambda n, text: bad.append(n))
    if bad:
        notes.append(f"{path.relative_to(root)}: skipped {len(bad)} incomplete or invalid line(s) "
                     f"(line {', '.join(map(str, bad[:5]))}); a job was killed while writing, or the file is damaged.")
    return frame


def read_json_tolerant(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        return d if isinstance(d, dict) else None
    except (FileNotFoundError, ValueError, OSError):
        return None


def read_config_leniently(rd: RunDir, notes: list[str]) -> Optional[RunConfig]:
    """The run's config; if this hpcrl cannot parse it (another version wrote it), read
    the keys it knows, keep the defaults for the rest and say which keys were ignored."""
    try:
        return rd.load_config()
    except FileNotFoundError:
        notes.append(f"{rd.config_path.name} is missing: knobs (s, K, R) and the lag bound are unknown.")
        return None
    except ConfigError as strict_error:
        try:
            raw = yaml.safe_load(rd.config_path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            notes.append(f"{rd.config_path.name} is unreadable ({e}): knobs and the lag bound are unknown.")
            return None
        ignored: list[str] = []
        tree = _known_keys(RunConfig, raw, "", ignored)
        try:
            cfg = config_from_dict(tree)
        except (ConfigError, TypeError) as e:
            notes.append(f"{rd.config_path.name} does not match this hpcrl version ({strict_error}) and cannot be read "
                         f"leniently either ({e}): knobs and the lag bound are unknown.")
            return None
        notes.append(f"{rd.config_path.name} was written by another hpcrl version ({strict_error}); read leniently, "
                     f"ignoring {', '.join(ignored) or 'nothing'}; fields it lacks take today's defaults.")
        return cfg


def _known_keys(cls, raw, prefix: str, ignored: list[str]) -> dict:
    """The part of ``raw`` that names fields of ``cls`` (recursively); the other keys go to ``ignored``."""
    if not isinstance(raw, dict):
        return {}
    hints = typing.get_type_hints(cls)
    out = {}
    for k, v in raw.items():
        if k not in hints:
            ignored.append(f"{prefix}{k}")
        elif dataclasses.is_dataclass(hints[k]):
            out[k] = _known_keys(hints[k], v, f"{prefix}{k}.", ignored)
        else:
            out[k] = v
    return out


def _frame(df: pd.DataFrame, required: list[str], name: str, missing: dict) -> pd.DataFrame:
    if len(df):
        gaps = [c for c in required if c not in df.columns]
        if gaps:
            missing[name] = gaps
        for c in gaps:  # absent in an older format: NaN (numbers) or "" (text), so sums say n/a instead of failing
            df[c] = "" if c in ("dropped", "writer", "shard", "sample_id", "group_id") else np.nan
    else:
        df = pd.DataFrame(columns=required)
    return df


def _time_origin(st: pd.DataFrame, m: pd.DataFrame, ro: pd.DataFrame) -> float:
    """The earliest event: first generation start, first trainer wait, first weight load."""
    cands = []
    if not st.empty and st["created_s"].notna().any():
        cands.append(float(st["created_s"].min()))
    if not m.empty and m["time_s"].notna().any():
        step = m[[M.WAIT_SAMPLES_S, M.UPDATE_S, M.PARAM_SYNC_S]].fillna(0).sum(axis=1)
        cands.append(float((m["time_s"] - step).min()))
    if not ro.empty and ro["time_s"].notna().any():
        cands.append(float((ro["time_s"] - ro["wall_s"].fillna(0) - ro[M.LOAD_WEIGHTS_S].fillna(0)).min()))
    return min(cands) if cands else 0.0


def read_evals(rd: RunDir) -> tuple[list, pd.DataFrame]:
    """Every row of the eval log, and the evaluated ones as a frame (the job's; ``hpcrl eval``'s if the job
    wrote none), one row per version (the last row of a version evaluated twice), metrics as columns."""
    rows = read_eval_rows(rd.eval_log)
    done = [r for r in rows if r.status == EVALUATED]
    done = [r for r in done if r.source == JOB] or done
    if not done:
        return rows, pd.DataFrame()
    frame = pd.DataFrame([{"version": r.version, "trainer_step": r.trainer_step, "published_s": r.published_s,
                           "finished_s": r.finished_s, "score": r.score, "score_name": r.score_name, "n": r.n,
                           "prompts": r.prompts, "eval_s": r.eval_s, "source": r.source, **r.metrics} for r in done])
    return rows, frame.drop_duplicates("version", keep="last").sort_values("version").reset_index(drop=True)


def load_run(path: os.PathLike | str, name: Optional[str] = None) -> RunData:
    """Everything the report needs from one run directory (read-only)."""
    rd = RunDir(path)
    root = rd.root
    if not root.is_dir():
        raise RunFormatError(f"{root}: no such directory")
    if not rd.config_path.is_file() and not rd.logs.is_dir():
        raise RunFormatError(f"{root} is not an hpcrl run directory (no config.yaml and no logs/); "
                             "pass the --run-dir of `hpcrl run`")
    notes: list[str] = []
    cfg = read_config_leniently(rd, notes)
    missing: dict[str, list[str]] = {}
    st = _frame(_read_log(rd.staleness, notes, root), STALENESS_COLUMNS, "staleness", missing)
    m = _frame(_read_log(rd.metrics, notes, root), METRICS_COLUMNS, "metrics", missing)
    for c in COUNTERS:
        if c not in m.columns:
            m[c] = 0
    ro_logs = [_read_log(p, notes, root) for p in rd.rollout_metrics_logs().values()]
    ro_logs = [f for f in ro_logs if len(f)]
    ro = _frame(pd.concat(ro_logs, ignore_index=True) if ro_logs else pd.DataFrame(), ROLLOUT_COLUMNS, "rollout",
                missing)
    eval_rows, evals = read_evals(rd)
    if st.empty and m.empty and ro.empty and evals.empty:
        fatal = read_fatal(rd)
        raise RunFormatError(f"{root}: nothing to analyse yet: {rd.staleness.name}, {rd.metrics.name} and "
                             f"rollout-*.jsonl in {rd.logs} are empty or missing " + (
                                 f"(the run stopped before its first update, on an error no restart can fix: {fatal})"
                                 if fatal else "(has the trainer made its first update?)"))
    read_from = {**LOG_PATHS, "staleness": str(rd.staleness.relative_to(root))}  # an older run's is plain
    for name_, cols in missing.items():
        notes.append(f"{read_from[name_]} lacks column(s) {', '.join(cols)}: it was written by an older hpcrl "
                     "version; the sections that need them are left out.")
    if not m.empty and "step" in m and m["step"].notna().all():
        m = m.sort_values("step", kind="stable").reset_index(drop=True)
    done = read_trainer_done(rd)
    heartbeats = read_heartbeats(rd)
    if done is None:
        states = ", ".join(f"{j} {h.state}" for j, h in heartbeats.items()) or "no heartbeats"
        notes.append(f"The run has not finished (no {rd.trainer_done.relative_to(rd.root)}; jobs: {states}): the numbers cover "
                     f"the {len(m)} update(s) logged so far.")
    return RunData(name=name or root.name, root=root, knobs=cfg.knobs if cfg else None, staleness=st,
                   metrics=m, rollout=ro, heartbeats=heartbeats, trainer_done=done, t0_s=_time_origin(st, m, ro),
                   notes=notes, missing=missing, evals=evals, eval_rows=eval_rows,
                   eval_enabled=bool(cfg and cfg.eval.enabled))
