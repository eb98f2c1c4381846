"""SIGTERM (``scancel``, a node shutdown, the end of a local run): stop the job now.

The handler raises ``SystemExit`` so that a wait or a generation in progress
ends at once; the job's ``finally`` blocks then seal the complete groups (a
rollout job) and write the final heartbeat. Nothing is checkpointed: a trainer
restarts from its last checkpoint, whose sample cursor is consistent with it.

Python runs a signal handler between two bytecodes of the main thread. When
that moment falls inside a garbage-collector callback (a weakref finalizer, a
``__del__``), the exception it raises is printed as "Exception ignored in ..."
and dropped, and the job would run on, still writing samples, until Slurm's
SIGKILL ``KillWait`` seconds later. Seen in the test suite: a scancel'd rollout
job went on producing groups for 15 s. So the handler also records the signal,
and the job loops call :func:`check` at every step (``fsio.wait_for`` at every
poll), which raises again.

A job can also stop itself this way for a failure it found on another thread (a start-up step past
its deadline): :func:`stop_self` records the reason and sends SIGTERM to the process, so the job
unwinds exactly as on ``scancel``, but ends as failed, with the reason in the exit message.

A few steps must not be cut in half: a shard commit makes its manifest line
durable and then records it in memory; a SystemExit between the two made the
shutdown path seal the same groups again (same prompts committed twice, a
committed shard overwritten). Such a step runs inside :func:`deferred`: the
handler then only records the signal, and the SystemExit is raised when the
outermost ``deferred`` block ends (an exception from the block itself wins).
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterator, Optional

_received: Optional[int] = None
_reason: Optional[str] = None
_defer_depth = 0


def _message(signum: int) -> str:
    return f"stopping: {_reason}" if _reason else f"received {signal.Signals(signum).name}: stopping"


def _handler(signum, frame) -> None:
    global _received
    _received = signum
    if _defer_depth == 0:
        raise SystemExit(_message(signum))


@contextmanager
def deferred() -> Iterator[None]:
    """Run a block that SIGTERM must not interrupt; a SIGTERM received meanwhile raises
    SystemExit when the (outermost) block ends. Main thread only, like the handler."""
    global _defer_depth
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
    if _defer_depth == 0:
        check()


def install() -> None:
    """In a job's main thread: SIGTERM stops the job (see the module docstring)."""
    global _received, _reason
    _received, _reason = None, None
    signal.signal(signal.SIGTERM, _handler)


def stop_self(reason: str) -> None:
    """From any thread: stop this job as SIGTERM would, but as a failure for ``reason`` (one line)."""
    global _reason
    _reason = reason
    os.kill(os.getpid(), signal.SIGTERM)


def failure_reason() -> Optional[str]:
    """Why the job stopped itself (:func:`stop_self`), or None."""
    return _reason


def received() -> Optional[int]:
    """The stopping signal this job received, or None."""
    return _received


def check() -> None:
    """Raise SystemExit if SIGTERM arrived, even when the handler's own raise was swallowed."""
    if _received is not None:
        raise SystemExit(_message(_received) if _reason else f"received {signal.Signals(_received).name} earlier: "
                         "stopping")
