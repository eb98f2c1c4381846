"""The rollout fleet's size, changed on a live run: drain requests and scale requests.

=====================================  ===============================  ==========================================
record                                 written by                       read by
=====================================  ===============================  ==========================================
drain/<writer>.json  (DrainRequest)    ``launcher/fleet.py`` (the       that writer's rollout job (drain, exit 0),
                                       launcher, ``hpcrl scale``)       the launcher (never resubmit it), status
scale.json           (ScaleRequest)    ``hpcrl scale``                  the launcher following the run
=====================================  ===============================  ==========================================

A drained rollout job stops admitting, lets its groups in flight finish, seals them, releases its admission
budget and its open prompt claims (``control/claims.py``), ends ``drained`` and exits 0; a drain record is never
removed, so a requeued or resubmitted job of that writer drains again at once, and the launcher gives growing
fleets new writer numbers. Both records are written tmp -> fsync -> rename.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from hpcrl.control.changes import bump
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir


@dataclass
class DrainRequest(JsonRecord):
    """``control/drain/<writer>.json``: that writer's job leaves the fleet for good (module docstring)."""

    requested_s: float
    """Unix time of the request."""
    by: str
    """Who asked and why, for the logs (``hpcrl scale --rollout-jobs 2``)."""


@dataclass
class ScaleRequest(JsonRecord):
    """``control/scale.json``: the number of rollout jobs the fleet should have; the launcher following the run
    submits new jobs or drains the newest ones, and acknowledges by writing ``applied_s``."""

    rollout_jobs: Optional[int]
    """The fleet size asked for (>= 1; None: unchanged, a request for reward jobs only)."""
    requested_s: float
    by: str
    applied_s: float = 0.0
    """When the launcher acted on it (0: not yet)."""
    reward_jobs: Optional[int] = None
    """The reward jobs asked for (``resources.reward_jobs``; None: unchanged)."""


def request_drain(run_dir: RunDir, writer: str, by: str) -> None:
    """Ask ``writer``'s job to leave the fleet (idempotent: the first request is kept)."""
    path = run_dir.drain_request(writer)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, DrainRequest(time.time(), by).to_json())
        bump(run_dir, f"{writer} asked to drain", by)


def drain_requested(run_dir: RunDir, writer: str) -> bool:
    """``writer`` was asked to drain (one stat of the shared filesystem)."""
    return run_dir.drain_request(writer).exists()


def drained_writers(run_dir: RunDir) -> set[str]:
    """Writers asked to drain, ever."""
    folder = run_dir.drain_requests
    return {p.stem for p in folder.glob("*.json")} if folder.is_dir() else set()


def request_scale(run_dir: RunDir, rollout_jobs: Optional[int], by: str, reward_jobs: Optional[int] = None
                  ) -> ScaleRequest:
    """Ask the launcher following the run for ``rollout_jobs`` rollout jobs and ``reward_jobs`` reward jobs (None:
    unchanged)."""
    req = ScaleRequest(rollout_jobs, time.time(), by, reward_jobs=reward_jobs)
    write_json_atomic(run_dir.scale_request, req.to_json())
    return req


def read_scale_request(run_dir: RunDir) -> Optional[ScaleRequest]:
    """The newest scale request, None if there is none (or it is not one: the next write replaces it)."""
    try:
        d = read_json(run_dir.scale_request)
        return ScaleRequest.from_json(d) if d is not None else None
    except (ValueError, OSError):
        return None


def acknowledge_scale(run_dir: RunDir, req: ScaleRequest) -> None:
    """The launcher acted on ``req`` (if it is still the newest request)."""
    now = read_scale_request(run_dir)
    if now is not None and now.requested_s == req.requested_s:
        now.applied_s = time.time()
        write_json_atomic(run_dir.scale_request, now.to_json())
