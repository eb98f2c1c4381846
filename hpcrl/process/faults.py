"""Test-only fault injection: make a job stop or stall at a named instant.

Inert unless the environment variable ``HPCRL_FAULT_POINT`` is set (the soak
harness ``bench/soak.py`` and ``tests/test_soak.py`` set it for one job)::

    HPCRL_FAULT_POINT=<point>:<n>:<action>[,<point>:<n>:<action> ...]

At the ``n``-th time (1-based; ``every``: every time) this process reaches ``point`` it performs
``action`` (with ``HPCRL_FAULT_ONCE=<file>`` only if that file does not exist yet: the fault creates it, so it
fires once across the job's restarts, not once per process): ``term`` (SIGTERM to itself), ``kill`` (SIGKILL to itself),
``sleep=<seconds>``, ``fail`` (raise :class:`InjectedFault` there), ``errno=<NAME>`` (raise ``OSError`` with that
errno, e.g. ``ENOSPC``, ``EIO``, ``ESTALE``: a write that fails) or ``fill=<file>`` (write ``<file>`` until its
filesystem is full: the next write there meets a real ENOSPC; the test frees the space by removing it). Several
specs, comma-separated, each count on their own. Points, each placed at the instant a step begins:

================  ===================================================================
point             where
================  ===================================================================
seal_manifest     ShardWriter.seal, just before the manifest line (the commit) is appended
checkpoint        trainer, before a checkpoint is saved
publish           trainer, before a weight version is written
delta_write       trainer, a delta version's ``model.delta`` written, before its folder is renamed and committed
weight_load       rollout, before a weight version is loaded
engine_load       rollout, as verified weights are handed to the engine
broadcast_bucket  trainer or rollout, before each bucket of a weight broadcast is sent or received
startup           trainer or rollout, as each start-up step begins (``control/startup.py``)
op_build          trainer, as DeepSpeed's op build begins (in the build's own process)
eval_prompt       evaluation, before each held-out prompt's generation is started
tool_call         rollout, as an agent's tool call begins (in its worker thread: ``sleep`` holds the call)
write             any job, as each write to the run directory begins (``disk.guarded``)
metrics_log       trainer, before an update's metrics row is appended
states_save       rollout, before the states of its groups in flight are saved
eval_commit       evaluation, before a version's samples and row are appended
change_look       any job, as it looks whether ``control/changes.jsonl`` grew (``sleep``: a job slow to notice)
================  ===================================================================
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import time

ENV = "HPCRL_FAULT_POINT"
ONCE_ENV = "HPCRL_FAULT_ONCE"
POINTS = ("seal_manifest", "checkpoint", "publish", "delta_write", "weight_load", "engine_load", "broadcast_bucket",
          "startup", "op_build", "eval_prompt", "tool_call", "write", "metrics_log", "states_save", "eval_commit",
          "change_look")

log = logging.getLogger(__name__)
_specs = [spec.split(":", 2) for spec in os.environ.get(ENV, "").split(",") if spec]
_counts: dict[int, int] = {}


class InjectedFault(RuntimeError):
    """Raised by the ``fail`` action."""


def _first_firing() -> bool:
    """True unless ``HPCRL_FAULT_ONCE`` names a file that exists (an earlier process of the job fired); creates it."""
    once = os.environ.get(ONCE_ENV)
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def point(name: str) -> None:
    """Count one arrival at ``name``; act if ``HPCRL_FAULT_POINT`` names this arrival."""
    due = []
    for i, (target, n, action) in enumerate(_specs):  # every spec counts this arrival before any acts
        if target == name:
            _counts[i] = _counts.get(i, 0) + 1
            if n == "every" or _counts[i] == int(n):
                due.append((n, action))
    for n, action in due:
        if not _first_firing():
            continue
        if n != "every":
            log.warning("fault injection (%s=%s:%s:%s): %s at %s #%s", ENV, name, n, action, action, name, n)
        _act(action, f"{name}:{n}:{action}")


def _act(action: str, spec: str) -> None:
    if action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))
    elif action == "fail":
        raise InjectedFault(f"{ENV}={spec}")
    elif action.startswith("errno="):
        code = getattr(errno, action.split("=", 1)[1])
        raise OSError(code, f"{os.strerror(code)} ({ENV}={spec})")
    elif action.startswith("fill="):
        fill(action.split("=", 1)[1])
    else:
        raise ValueError(f"{ENV}={spec}: action must be term, kill, sleep=<seconds>, fail, errno=<NAME> or "
                         f"fill=<file>, got {action!r}")


def fill(path: str) -> int:
    """Write ``path`` until its filesystem has no room left; the bytes written (the file stays)."""
    written, size = 0, 1 << 20
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while size >= 4096:
            try:
                written += os.write(fd, b"\0" * size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                size //= 16  # the last free pages, in smaller writes
    finally:
        os.close(fd)
    log.warning("fault injection: filled the filesystem of %s (%d bytes)", path, written)
    return written
