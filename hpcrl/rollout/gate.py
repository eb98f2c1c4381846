"""Where the group threads (generating) and the rollout loop (switching weights) meet.

A group's thread enters the gate before every round of engine calls and gets the version to
generate with. Without partial rollout the loop drains the groups in flight before it loads new
weights, so every response is one segment of one version. With partial rollout the loop instead
*closes* the gate, aborts the engine's generations (they come back within about one decoding step
with the tokens and log-probs so far), waits until every group in flight has either finished or is
parked at the gate (so no generate call is running and finished groups commit first), loads the new
version and opens the gate again; each unfinished trajectory then continues as a new request from
prompt + tokens so far with what is left of its token budget.

What a thread waits for: the gate to open, at most ``timeouts.generate_s``. When the job stops,
:meth:`EngineGate.stop` wakes it and the unfinished group is dropped (its state is saved for the
job's successor, ``in_flight.py``).
"""
from __future__ import annotations

import threading


class GroupAborted(Exception):
    """A group's generation was stopped (job shutting down): its partial trajectories are not a group."""


class EngineGate:
    """Open while generation may run; closed during a weight switch; stopped when the job stops."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open = False
        self._stopping = False
        self.parked = 0
        """Threads waiting in :meth:`enter` (their group has an unfinished trajectory)."""
        self.version = -1

    def enter(self, timeout_s: float) -> int:
        """Wait until the gate is open (counted in :attr:`parked` meanwhile); the version to generate with."""
        with self._cond:
            self.parked += 1
            try:
                if not self._cond.wait_for(lambda: self._open or self._stopping, timeout_s):
                    raise TimeoutError(f"a weight switch kept the engine closed for more than {timeout_s:.0f}s")
            finally:
                self.parked -= 1
            if self._stopping:
                raise GroupAborted("the rollout job is stopping")
            return self.version

    def is_open(self) -> bool:
        """Whether a generate call may start now (no weight switch in progress, job not stopping)."""
        return self._open and not self._stopping

    @property
    def stopping(self) -> bool:
        """The job is stopping (:meth:`stop` was called)."""
        return self._stopping

    def close(self) -> None:
        """No new generate call starts until :meth:`open`."""
        with self._cond:
            self._open = False

    def open(self, version: int) -> None:
        """Generation goes on with ``version``."""
        with self._cond:
            self.version, self._open = version, True
            self._cond.notify_all()

    def stop(self) -> None:
        """The job is stopping: every waiting or later :meth:`enter` raises GroupAborted."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
