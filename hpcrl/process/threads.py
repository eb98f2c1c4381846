"""Background threads that may sit in a native call (the weight broadcast's), and why the process
waits for them at exit.

CPython 3.11 ends a daemon thread that comes back from a native call after interpreter shutdown
began by unwinding its stack (``pthread_exit``). Inside torch's bindings that unwind meets a
``noexcept`` destructor and the process aborts: ``terminate called without an active
exception``, exit status 134, after the job's work was done (seen: a rollout process that had
loaded its last version by broadcast, while its receiver thread sat in ``store.check``).

So every such thread (the broadcast's admission, receiver and transfer threads) is started by
:func:`spawn`, which records how long it can still take, and an ``atexit`` hook (atexit runs before shutdown freezes daemon threads) stops
them and waits for each, at most that long, saying what it waits for.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    """A broadcast thread the process waits for at exit."""

    thread: threading.Thread
    stop: Optional[threading.Event]  # set at exit; None: the thread ends by itself
    bound_s: float  # with stop: seconds it may still take once stopped; without: seconds from start_s
    start_s: float  # time.monotonic() at start

    def deadline_s(self, now_s: float) -> float:
        """The monotonic time by which it ends if stopped at ``now_s``."""
        return now_s + self.bound_s if self.stop is not None else self.start_s + self.bound_s

    def stop_and_wait(self) -> None:
        """Set its stop event and wait for it to end, at most ``bound_s``."""
        if self.stop is not None:
            self.stop.set()
        self.thread.join(self.bound_s)


_LOCK = threading.Lock()
_THREADS: list[Tracked] = []


def spawn(target: Callable[[], None], name: str, bound_s: float, stop: Optional[threading.Event] = None) -> Tracked:
    """Start ``target`` on a daemon thread that the process waits for at exit. With ``stop``: the
    thread returns within ``bound_s`` once ``stop`` is set; without: it ends within ``bound_s``."""
    x = Tracked(threading.Thread(target=target, name=name, daemon=True), stop, bound_s, time.monotonic())
    with _LOCK:
        _THREADS[:] = [t for t in _THREADS if t.thread.is_alive()]
        _THREADS.append(x)
    x.thread.start()
    return x


@atexit.register
def wait_for_threads_at_exit() -> None:
    """Stop the broadcast's threads and wait for each to leave torch (module docstring)."""
    with _LOCK:
        live = [x for x in _THREADS if x.thread.is_alive()]
    for x in live:
        if x.stop is not None:
            x.stop.set()
    now = time.monotonic()
    for x in sorted(live, key=lambda x: x.deadline_s(now)):
        x.thread.join(min(1.0, max(x.deadline_s(now) - time.monotonic(), 0.0)))
        if x.thread.is_alive():
            left = max(x.deadline_s(now) - time.monotonic(), 0.0)
            log.info("exit: waiting up to %.0fs for the thread %r to end (a weight broadcast step in flight)",
                     left, x.thread.name)
            x.thread.join(left)
        if x.thread.is_alive():
            log.warning("exit: the thread %r did not end in time; the process may abort while exiting "
                        "(its work is done)", x.thread.name)
