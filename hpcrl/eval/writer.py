"""The one writer of ``logs/eval.jsonl`` and ``logs/eval_samples.jsonl.gz`` (the records: ``hpcrl/logs/eval_log.py``).

At open it recovers what a killed predecessor left: a torn last row is cut, and samples appended after the
last row (a version whose row never came) are cut back to that row's ``samples_bytes``; so the version is
evaluated again, whole, and nothing is counted twice. :meth:`EvalLogWriter.commit` appends a version's
samples, then its row (the commit point), both inside ``termination.deferred``: SIGTERM cannot split them.

Retention (``eval.keep_samples_versions``): after each commit, the samples of all but the newest K versions that
have samples are released from the head of the (compressed) samples file (``disk.release_head``: a hole, so the
offsets the rows hold stay true); their rows and metrics stay.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from hpcrl.logs.eval_log import EvalRow, EvalSample, committed_samples_bytes, read_eval_rows
from hpcrl.rundir.fsio import JsonlAppender, is_compressed, truncate_torn_tail
from hpcrl.rundir.disk import release_head
from hpcrl.logs.run_logs import log_size, truncate_to
from hpcrl.process import faults, termination

log = logging.getLogger(__name__)


class EvalLogWriter:
    """Appends evaluated versions to an eval log and its samples log (module docstring)."""

    def __init__(self, rows_path: Path, samples_path: Path, keep_samples_versions: int = -1):
        self.rows_path, self.samples_path = rows_path, samples_path
        self.keep_samples_versions = keep_samples_versions
        self._released = 0  # the samples file's head given back so far (bytes)
        self._cannot_release = False
        cut = truncate_torn_tail(rows_path)
        if cut:
            log.warning("%s: cut %d bytes of a row torn by a killed writer", rows_path, cut)
        self.rows: list[EvalRow] = read_eval_rows(rows_path)
        """Every valid row so far (both sources), in order."""
        keep, size = committed_samples_bytes(self.rows), log_size(samples_path)
        if size > keep:
            log.warning("%s: removing %d bytes of samples of an evaluation that was not finished (no row in %s)",
                        samples_path, size - keep, rows_path.name)
            truncate_to(samples_path, keep)
        elif size < keep:
            log.warning("%s holds %d bytes, the rows of %s commit %d: samples of earlier versions are missing",
                        samples_path, size, rows_path.name, keep)
        self._rows = JsonlAppender(rows_path)
        self._samples = JsonlAppender(samples_path)

    def commit(self, row: EvalRow, samples: list[EvalSample] = ()) -> EvalRow:
        """Append ``samples`` then ``row`` (with its sample count, the samples file's size and the time), durably;
        SIGTERM meanwhile takes effect after both."""
        with termination.deferred():
            faults.point("eval_commit")
            self._samples.append_many([s.to_json() for s in samples])
            row.samples = len(samples)
            row.samples_bytes = log_size(self.samples_path)
            row.finished_s = time.time()
            self._rows.append(row.to_json())
        self.rows.append(row)
        self._release_old_samples()
        return row

    def _release_old_samples(self) -> None:
        """Give back the samples of all but the newest ``keep_samples_versions`` versions with samples (module
        docstring); a filesystem that cannot is said once, and everything is kept."""
        if self.keep_samples_versions < 0 or self._cannot_release or not is_compressed(self.samples_path):
            return
        with_samples = [i for i, r in enumerate(self.rows) if r.samples > 0]
        if len(with_samples) <= self.keep_samples_versions:
            return
        first_kept = with_samples[-self.keep_samples_versions]
        head = self.rows[first_kept - 1].samples_bytes if first_kept > 0 else 0
        if head <= self._released:
            return
        if release_head(self.samples_path, head):
            self._released = head
            log.debug("%s: released the samples before v%d (%d bytes)", self.samples_path,
                      self.rows[first_kept].version, head)
        else:
            self._cannot_release = True
            log.warning("%s: this filesystem cannot release the head of a file (fallocate hole punching): the "
                        "responses of every evaluated version are kept (eval.keep_samples_versions)", self.samples_path)

    def close(self) -> None:
        """Close both files."""
        self._rows.close()
        self._samples.close()
