"""One file whose growth says "something a waiting job looks for has changed": ``control/changes.jsonl``.

Why: a job that polls the run directory for what it waits for (a new weight version, a stop request,
a drain request, the trainer's end, a skipped shard, budget handed back) stats or lists several paths
per poll; a thousand jobs doing that every 0.05 s is what a Lustre metadata server does not survive
(``bench/bench_scale.py``). Instead, every writer of such a change appends one line here *after* the
change (:func:`bump`), and a poller stats this one file (:class:`ChangeWatch`) and looks at the rest only
when it grew.

- Writers append (``O_APPEND``, one short JSON line: who, what, when; no fsync: it is a hint, never
  the truth). The size only grows, so "changed" is "the size (or the file) differs from what I saw": no
  counter to read-modify-write, no lock, and two writers racing on a filesystem without atomic appends
  (NFS) still grow it. Nothing parses it but people (``tail control/changes.jsonl`` shows the run's
  changes).
- A poller stats it at most every ``interval``: ``timeouts.poll_interval_s`` after a change, then a quarter of
  the time since the last change (:func:`backoff_s`) up to ``timeouts.poll_max_s`` (so a change is seen at most
  that late, and at most a quarter of the wait late), and it reports a change every :data:`RESCAN_S` anyway: a
  writer killed between its change and its bump, or one that does not bump (an older hpcrl), delays a reaction
  by that much at most, never forever.
- Order: the poller takes the file's stamp *before* it looks at the rest, and writers bump *after* their
  change, so a change is never missed: if the bump comes after the stamp, the next stat sees it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Optional

from hpcrl.process import faults
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)

RESCAN_S = 10.0
"""A watch reports a change at least this often, whatever the file says (module docstring)."""

LATE_SHARE = 0.25
"""A poll that has waited ``w`` seconds sleeps ``w * LATE_SHARE`` before its next look (:func:`backoff_s`)."""


def backoff_s(waited_s: float, min_s: float, max_s: float) -> float:
    """Seconds until the next look of a poll that has waited ``waited_s`` since it last saw a change: a quarter of
    that, within ``[min_s, max_s]``. So what it waits for is seen at most a quarter of the wait late (or ``min_s``,
    or ``max_s``), where doubling the sleep would see it up to a whole wait late (a tiny run's updates took twice as
    long). Past ``4 * max_s`` of waiting it looks every ``max_s``, as doubling does, so a long wait costs the
    metadata server about the same: with the defaults (0.05 s, 0.5 s) a wait of 60 s looks 131 times (doubling: 123),
    one of 2 s 15 times (doubling: 7)."""
    return min(max(waited_s * LATE_SHARE, min_s), max_s)


def bump(run_dir: RunDir, what: str, by: str = "") -> None:
    """Tell every poller of ``run_dir`` that something changed (call it after the change is visible). Never fails
    the caller: a line that cannot be written (no ``control/`` yet, a full disk) only delays the pollers until
    their next rescan (:data:`RESCAN_S`)."""
    line = json.dumps({"what": what, "by": by or f"{socket.gethostname()}:{os.getpid()}", "time_s": time.time()})
    try:
        fd = os.open(run_dir.changes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except FileNotFoundError:  # no control/ yet (a run directory being prepared): nobody polls it either
        return
    except OSError as e:
        log.warning("could not append to %s (%s): pollers see this change at their next rescan (%.0fs at most)",
                    run_dir.changes, e.strerror, RESCAN_S)


class ChangeWatch:
    """A job's view of ``control/changes.jsonl``, shared by the parts of its loop that wait for something (each
    names itself: ``stop``, ``weights``, ...). It stats the file at most every interval, which backs off from
    ``min_s`` to ``max_s`` while nothing changes (:func:`backoff_s`); a growth, or :data:`RESCAN_S` passing, is
    reported once to each part (:meth:`changed`), so one stat serves them all."""

    def __init__(self, run_dir: RunDir, min_s: float, max_s: float, rescan_s: float = RESCAN_S):
        self.path = run_dir.changes
        self.min_s, self.max_s, self.rescan_s = min_s, max(min_s, max_s), rescan_s
        self.interval_s = min_s
        self._stamp: Optional[tuple[int, int]] = None
        self._next_s = 0.0  # monotonic time of the next stat
        self._quiet_since = time.monotonic()  # monotonic time of the last change seen
        self._rescan_at = 0.0  # monotonic time of the next report whatever the file says
        self._parts: set[str] = set()  # every part that asked
        self._due: set[str] = set()  # the parts not told of the last change yet

    def _read_stamp(self) -> Optional[tuple[int, int]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size

    def _look(self) -> None:
        now = time.monotonic()
        if now < self._next_s:
            return
        faults.point("change_look")  # a test's slow job: it looks late
        stamp = self._read_stamp()
        moved = stamp != self._stamp
        self._stamp = stamp
        if moved:
            self._quiet_since = now
        self.interval_s = backoff_s(now - self._quiet_since, self.min_s, self.max_s)
        self._next_s = now + self.interval_s
        if moved or now >= self._rescan_at:
            self._rescan_at = now + self.rescan_s
            self._due = set(self._parts)

    def changed(self, part: str) -> bool:
        """Whether ``part`` should look at what it waits for now: the first time it asks, and then once after each
        change (module docstring)."""
        if part not in self._parts:
            self._parts.add(part)
            self._look()
            self._due.discard(part)
            return True
        self._look()
        if part in self._due:
            self._due.discard(part)
            return True
        return False
