"""The admission budget shared by every rollout job of a run.

ARCHITECTURE.md "Admission budget with skips": per weight version the fleet may *start* at most
``B = floor((1 + s) * K * R)`` groups, counting carry-over (groups in flight or
committed but not yet consumed). Counting from the start of the run this is one
inequality, checked before each group starts::

    started_total - skipped_total  <  consumed_groups(v) + B

where ``v`` is the version the asking job generates with,
``consumed_groups(v)`` is written by the trainer into v's weight manifest
(groups trained on or dropped for staleness), and ``skipped_total`` counts the
groups of shards the trainer skipped as damaged (``control/skipped_shards.jsonl``,
see ``samples/skips.py``): they were started and will never be consumed, so the
budget they held is given back, and their writer generates their prompts again.

``started_total`` is the sum of per-writer counters in ``control/admission.json``
(:class:`AdmissionRecord`),
read-modified-written under an exclusive ``flock`` on ``control/admission.lock``
(the file itself is replaced atomically, so readers without the lock never see
a torn file). A writer that restarts resets its own counter to the number of
groups it has committed: the groups its dead predecessor had in flight are
released, and their prompts are regenerated.

Shared filesystems: flock works on local disks, NFSv4 and Lustre mounted with
``-o flock``; on a Lustre mount without it ``flock`` fails with ENOSYS and the
job stops with an error saying so.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from hpcrl.fsio import read_json, read_jsonl, write_json_atomic
from hpcrl.json_record import JsonRecord
from hpcrl.run_dir import RunDir
from hpcrl.samples.skips import SkipLog


log = logging.getLogger(__name__)


class AdmissionLockUnsupported(RuntimeError):
    """The filesystem of the run directory refuses ``flock`` (the message says how to fix it)."""


@dataclass
class AdmissionRecord(JsonRecord):
    """``control/admission.json``: written and read by rollout jobs, under ``control/admission.lock``."""

    started: dict[str, int] = field(default_factory=dict)
    """Per writer: groups started. A writer resets its own entry at start to the groups in its
    committed manifest lines (skipped shards included), then adds one per group it starts."""

    @property
    def started_total(self) -> int:
        """Groups started by every writer."""
        return sum(self.started.values())


@contextmanager
def _locked(run_dir: RunDir):
    run_dir.control.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir.admission_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise AdmissionLockUnsupported(
                    f"flock on {run_dir.admission_lock} failed ({e}); the shared admission budget needs file "
                    "locks: mount Lustre with -o flock, or put the run directory on a filesystem with locking") from e
            raise
        yield
    finally:
        os.close(fd)  # releases the lock


class Admission:
    """One writer's view of the shared budget (see the module docstring)."""

    def __init__(self, run_dir: RunDir, writer: str, budget: int):
        self.run_dir = run_dir
        self.writer = writer
        self.budget = budget
        self.skips = SkipLog(run_dir)

    def _read(self) -> AdmissionRecord:
        """The record (the lock held); a damaged one is set aside and rebuilt (:meth:`_rebuild`)."""
        path = self.run_dir.admission
        if not path.exists():
            return AdmissionRecord()
        try:
            return AdmissionRecord.from_json(read_json(path), str(path))  # JSON null is not a record either
        except (ValueError, UnicodeDecodeError) as e:  # not JSON, or JSON that is not the record
            return self._rebuild(f"{type(e).__name__}: {e}")

    def _rebuild(self, why: str) -> AdmissionRecord:
        """Set the damaged record aside and count each writer's committed groups from its manifest instead (what
        a restarted writer resets its own count to). Groups other writers have in flight are not counted until
        they restart: the budget may be exceeded by that many once, which beats every writer failing at each
        start; logged."""
        path = self.run_dir.admission
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        os.replace(path, aside)
        started = {w: sum(int(line.get("n_groups", 0)) for line in read_jsonl(self.run_dir.shard_manifest(w))
                          if isinstance(line, dict)) for w in self.run_dir.writers()}
        log.error("%s was damaged (%s); moved to %s and rebuilt from the writers' manifests: %s (groups in flight "
                  "elsewhere are counted again when their writers restart)", path, why, aside.name, started)
        return AdmissionRecord(started=started)

    def reset_writer(self, committed_groups: int) -> None:
        """At writer start: groups in flight in a previous life of this writer are released."""
        with _locked(self.run_dir):
            state = self._read()
            state.started[self.writer] = committed_groups
            write_json_atomic(self.run_dir.admission, state.to_json())

    def try_start(self, consumed_groups_at_version: int) -> bool:
        """Reserve one group start if the budget allows; True if reserved."""
        self.skips.poll()  # only grows: a record read late gives less budget, never more
        with _locked(self.run_dir):
            state = self._read()
            if state.started_total - self.skips.skipped_groups() >= consumed_groups_at_version + self.budget:
                return False
            state.started[self.writer] = state.started.get(self.writer, 0) + 1
            write_json_atomic(self.run_dir.admission, state.to_json())
            return True
