"""Test-only fault injection: make a job stop or stall at a named instant.

Inert unless the environment variable ``HPCRL_FAULT_POINT`` is set (the soak
harness ``bench/soak.py`` and ``tests/test_soak.py`` set it for one job)::

    HPCRL_FAULT_POINT=<point>:<n>:<action>

At the ``n``-th time (1-based) this process reaches ``point`` it performs
``action`` (with ``HPCRL_FAULT_ONCE=<file>`` only if that file does not exist yet: the fault creates it, so it
fires once across the job's restarts, not once per process): ``term`` (SIGTERM to itself), ``kill`` (SIGKILL to itself),
``sleep=<seconds>`` or ``fail`` (raise :class:`InjectedFault` there). Points, each placed
at the instant a step begins:

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
================  ===================================================================
"""
from __future__ import annotations

import logging
import os
import signal
import time

ENV = "HPCRL_FAULT_POINT"
ONCE_ENV = "HPCRL_FAULT_ONCE"
POINTS = ("seal_manifest", "checkpoint", "publish", "delta_write", "weight_load", "engine_load", "broadcast_bucket", "startup",
          "op_build", "eval_prompt", "tool_call")

log = logging.getLogger(__name__)
_spec = os.environ.get(ENV)
_counts: dict[str, int] = {}


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
    if not _spec:
        return
    target, n, action = _spec.split(":", 2)
    if target != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] != int(n) or not _first_firing():
        return
    log.warning("fault injection (%s=%s): %s at %s #%s", ENV, _spec, action, name, n)
    if action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep="):
        time.sleep(float(action.split("=", 1)[1]))
    elif action == "fail":
        raise InjectedFault(f"{ENV}={_spec}")
    else:
        raise ValueError(f"{ENV}={_spec}: action must be term, kill, sleep=<seconds> or fail, got {action!r}")
