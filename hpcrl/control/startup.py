"""A job's start-up as named steps, each visible and bounded.

Before anything slow (DeepSpeed's op build, loading a model, starting an engine) a job enters a step:
its heartbeat says ``starting`` with the step's name and start time (``hpcrl status`` shows them),
and a watchdog gives the step ``timeouts.job_start_s`` (a step with its own limit, such as the engine
start, passes that). A step that overruns ends the job with one line naming the step and the limit:
the watchdog logs it and stops the job the way SIGTERM does (``termination.stop_self``: the job
unwinds, its heartbeat ends ``failed`` with the step in it, a restart may fix what a stuck node or
filesystem caused); a job whose main thread is stuck in native code and does not unwind within
``GRACE_S`` is ended at once with the same line.

Fault point ``startup`` (``process/faults.py``) is reached at the start of every step.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from hpcrl.control.records import HeartbeatState
from hpcrl.process import faults, termination

log = logging.getLogger(__name__)

GRACE_S = 30.0
"""After asking the job to stop, how long the watchdog waits for it to unwind before ending it at once."""


class StartupSteps:
    """The start-up steps of one job (module docstring). ``heartbeat`` is the job's heartbeat (or a stand-in
    with ``update`` and ``write`` on ranks that do not beat)."""

    def __init__(self, heartbeat, job: str, deadline_s: float):
        self.heartbeat = heartbeat
        self.job = job
        self.deadline_s = deadline_s
        self.current: Optional[str] = None
        """The step running, or None between steps."""

    @contextmanager
    def step(self, name: str, deadline_s: Optional[float] = None) -> Iterator[None]:
        """Run the body as start-up step ``name``, bounded by ``deadline_s`` (default ``timeouts.job_start_s``)."""
        limit_s = self.deadline_s if deadline_s is None else deadline_s
        self.current = name
        self.heartbeat.update(state=HeartbeatState.STARTING, step=name, step_started_s=time.time())
        self.heartbeat.write()
        log.info("start-up: %s (at most %.0fs)", name, limit_s)
        done = threading.Event()
        watchdog = threading.Thread(target=self._watch, args=(name, limit_s, done), name="startup-watchdog",
                                    daemon=True)
        watchdog.start()
        t0 = time.monotonic()
        try:
            faults.point("startup")
            yield
            log.info("start-up: %s done in %.1fs", name, time.monotonic() - t0)
        finally:
            done.set()
            self.current = None

    def _watch(self, name: str, limit_s: float, done: threading.Event) -> None:
        if done.wait(limit_s):
            return
        line = (f"{self.job}: start-up step '{name}' did not finish in {limit_s:.0f}s (timeouts.job_start_s); "
                "stopping the job")
        log.error("%s", line)
        termination.stop_self(f"start-up step '{name}' took longer than {limit_s:.0f}s")
        if done.wait(GRACE_S):
            return
        log.error("%s: it did not unwind in %.0fs (stuck in native code); ending it now", self.job, GRACE_S)
        self.heartbeat.update(state=HeartbeatState.FAILED)
        self.heartbeat.write()
        logging.shutdown()
        os._exit(1)
