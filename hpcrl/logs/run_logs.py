"""Run logs: metrics and the staleness log, append-only JSONL, one writer per file.

- ``logs/metrics.jsonl`` (trainer): one row per local update, verl's metric names
  where they exist (``trainer/idle_ratio``, ``fully_async/count/stale_samples_processed``,
  ``timing_s/param_sync``, ...).
- ``logs/rollout-<writer>.jsonl`` (each rollout job): one row per weight version
  it generated with (``rollouter/idle_ratio``, tokens/s, ...). The row of version v
  is written when v+1 has been loaded: its ``wall_s`` runs from v's load to then
  (so it includes the drain before v+1), ``timing_s/load_weights`` is v's own load.
- ``logs/staleness.jsonl.gz`` (trainer): one row per consumed trajectory; columns in
  :data:`hpcrl.logs.metric_names.STALENESS_COLUMNS`. The one log that grows with the batch (a row per trajectory:
  ~370 bytes each), so it is compressed, a gzip member per update (``zcat`` or ``pandas.read_json(path,
  lines=True)`` read it); 23x smaller on the tiny run. A run from an older hpcrl has ``logs/staleness.jsonl``,
  read (and continued) as it is.

Each row is written and fsync'd at once; a writer killed mid-row leaves at most
one partial last line, which the readers skip. A resumed trainer truncates its
two logs back to the byte offsets saved in its checkpoint, so rows of work that
the checkpoint does not contain are not counted twice (a compressed log's offsets fall where members end).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from hpcrl.rundir.fsio import JsonlAppender, read_jsonl, read_log_bytes
from hpcrl.rundir.disk import allocate_ahead
from hpcrl.process import faults
from hpcrl.logs.metric_names import STALENESS_COLUMNS  # noqa: F401 (the staleness log's columns, re-exported)
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)



def truncate_to(path: Path, size_bytes: int) -> None:
    """Roll an append-only log back to ``size_bytes`` (used on resume)."""
    if path.exists() and path.stat().st_size > size_bytes:
        with open(path, "r+b") as f:
            f.truncate(size_bytes)
            os.fsync(f.fileno())


def log_size(path: Path) -> int:
    """Bytes in a log (0 if it does not exist): what a checkpoint records to roll the log back to."""
    return path.stat().st_size if path.exists() else 0


class StalenessLog:
    """The trainer's ``logs/staleness.jsonl``: one row per consumed (or dropped) trajectory."""

    def __init__(self, run_dir: RunDir):
        self._out = JsonlAppender(run_dir.staleness)

    def write_groups(self, groups, trainer_version: int, trainer_step: int, consumed_s: float,
                     dropped: str = "") -> None:
        """One row per trajectory of ``groups``, consumed by update ``trainer_step`` at version ``trainer_version``."""
        rows = []
        for g in groups:
            for j, t in enumerate(g.trajectories):
                vs = int(t.token_versions.min()) if len(t.token_versions) else g.version_start
                ve = int(t.token_versions.max()) if len(t.token_versions) else g.version_end
                rows.append({
                    "sample_id": f"{g.sample_id}/{j}", "group_id": g.sample_id, "writer": g.writer, "shard": g.shard,
                    "version_start": vs, "version_end": ve, "trainer_version": trainer_version,
                    "trainer_step": trainer_step, "lag": trainer_version - vs,
                    "n_tokens": int(t.response_mask.sum()), "reward": float(t.reward),
                    "created_s": g.created_s, "finished_s": g.finished_s, "committed_s": g.committed_s,
                    "consumed_s": consumed_s, "dropped": dropped})
        self._out.append_many(rows)

    def close(self) -> None:
        """Close the file."""
        self._out.close()


def _warn(path):
    return lambda n, text: log.warning("%s line %d is incomplete or invalid, skipped: %r", path, n, text[:80])


# Always floats, even where a writer's value happened to be integral (a reward of 1).
FLOAT_COLUMNS = ("reward", "created_s", "finished_s", "committed_s", "consumed_s")


def read_jsonl_frame(path: os.PathLike | str, on_bad_line: Optional[Callable[[int, str], None]] = None):
    """A JSONL log (plain or ``*.gz``) as a pandas DataFrame, built column-wise: a run's staleness log has a
    row per trajectory (millions in a long run), and a list of row dicts costs ~2.6 kB
    per row against ~0.3 kB here (bench/bench_report.py).

    pyarrow parses the complete lines; a torn last line (a writer killed mid-row) is cut
    off and reported through ``on_bad_line`` like :func:`hpcrl.rundir.fsio.read_jsonl` does. A
    file pyarrow refuses (an invalid line in the middle, a NaN) is read again line by
    line by that tolerant reader, which skips and reports the bad lines.
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        data = read_log_bytes(path)
    except FileNotFoundError:
        return pd.DataFrame()
    cut = data.rfind(b"\n") + 1  # complete lines end here
    try:
        table = pj.read_json(pa.BufferReader(memoryview(data)[:cut])) if cut else None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        frame = pd.DataFrame(list(read_jsonl(path, on_bad_line=on_bad_line)))
    else:
        if cut < len(data) and on_bad_line:
            on_bad_line(data.count(b"\n", 0, cut) + 1, data[cut:].decode(errors="replace"))
        del data
        frame = table.to_pandas() if table is not None else pd.DataFrame()
    for c in set(FLOAT_COLUMNS) & set(frame.columns):
        frame[c] = frame[c].astype("float64")
    return frame


def read_staleness(run_dir: os.PathLike | str | RunDir):
    """The staleness log as a pandas DataFrame (columns :data:`hpcrl.logs.metric_names.STALENESS_COLUMNS`)."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return read_jsonl_frame(rd.staleness, on_bad_line=_warn(rd.staleness)).reindex(columns=STALENESS_COLUMNS)


def read_lengths(staleness_log: Path, spec: str) -> np.ndarray:
    """Every ``n_tokens`` of a run's staleness log (``RunDir.staleness`` of ``config.simulated.empirical_run``): the
    response lengths ``empirical:RUN`` draws from."""
    if not staleness_log.is_file():
        raise FileNotFoundError(f"simulated.lengths={spec}: {staleness_log} does not exist; point it at a finished "
                                "run directory, or use geometric / lognormal")
    lengths = [int(row["n_tokens"]) for row in read_jsonl(staleness_log)]
    if not lengths:
        raise ValueError(f"simulated.lengths={spec}: {staleness_log} has no rows")
    return np.maximum(1, np.asarray(lengths, dtype=np.int64))


def read_metrics(run_dir: os.PathLike | str | RunDir):
    """Trainer metrics (one row per local update) as a DataFrame."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return read_jsonl_frame(rd.metrics, on_bad_line=_warn(rd.metrics))


class MetricsLog:
    """An append-only JSONL log of metric rows (trainer metrics, a rollout job's per-version rows),
    optionally also sent to experiment trackers (:mod:`hpcrl.logs.trackers`)."""

    def __init__(self, path: Path, trackers=None):
        self._out = JsonlAppender(path)
        self._trackers = trackers

    def write(self, row: dict) -> None:
        """Append one row, durably; then hand it to the trackers."""
        faults.point("metrics_log")
        self._out.append(row)
        if self._trackers is not None:
            self._trackers.log(row)

    def close(self) -> None:
        """Close the file and the trackers."""
        self._out.close()
        if self._trackers is not None:
            self._trackers.close()


class JobLogFile(logging.FileHandler):
    """A job's log file (``RUN/logs/jobs/<job>.log``) that keeps :data:`ROOM_AHEAD_BYTES` allocated past its end
    (:func:`hpcrl.rundir.disk.allocate_ahead`), so that what a job says while the disk is full (that it waits for space, and
    for what; its last error) lands in the log the user and ``hpcrl status`` read: without it a line lands only if it
    fits the slack of the file's last page. The room is topped up once half of it is used; while the disk stays
    full, at each line (one system call)."""

    ROOM_AHEAD_BYTES = 64 << 10

    def __init__(self, path: Path):
        super().__init__(path)
        self._room_until = 0  # the file offset up to which appends cannot meet a full disk
        self._keep_room()

    def _keep_room(self) -> None:
        if self.stream is None:
            return
        end = self.stream.tell()
        if allocate_ahead(self.stream.fileno(), end, self.ROOM_AHEAD_BYTES):
            self._room_until = end + self.ROOM_AHEAD_BYTES

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if self.stream is not None and self.stream.tell() > self._room_until - self.ROOM_AHEAD_BYTES // 2:
            self._keep_room()


def setup_logging(job: str, level: str = "INFO", log_file: Path | None = None) -> None:
    """``logging`` with the job name in every line (the version/step go in messages)."""
    fmt = f"%(asctime)s {job} %(levelname)s %(name)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(JobLogFile(log_file))
    logging.basicConfig(level=getattr(logging, level), format=fmt, handlers=handlers, force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
