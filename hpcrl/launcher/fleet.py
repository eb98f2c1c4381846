"""Which rollout jobs a run has, and how the launcher grows or shrinks the fleet on a live run.

Writer numbers are never reused: a run launched with ``resources.rollout_jobs=N`` runs writers ``0..N-1`` (as
before the fleet could change); growing adds the next numbers never used (a folder in ``samples/``, a heartbeat
or a drain record uses one); shrinking drains the newest writers (``control/fleet.py``): each finishes its groups
in flight, seals, hands back its budget and prompt claims (``control/claims.py``) and exits 0, and the follower
never resubmits it. A job still queued or starting when it is drained has nothing to save: it is cancelled and
its claims (from an earlier life, if any) are released by the launcher, which knows that job has ended.

``resources.rollout_jobs`` in the frozen config follows the fleet (with a line in its history), so ``--resume``
starts the fleet as it was: the writers known and not drained, first.
"""
from __future__ import annotations

import logging
from typing import Callable

from hpcrl.config import RunConfig
from hpcrl.control.admission import read_claims, release_writer
from hpcrl.control.fleet import drained_writers, request_drain
from hpcrl.control.fleet_log import CANCELLED, DRAIN_REQUESTED, FleetLog
from hpcrl.control.records import HeartbeatState, read_heartbeats
from hpcrl.run_dir import RunDir

log = logging.getLogger(__name__)


def used_writer_ids(rd: RunDir) -> set[int]:
    """Writer numbers this run has used: sample folders, rollout heartbeats, drain records, prompt claims."""
    names = set(rd.writers()) | drained_writers(rd)
    book = read_claims(rd)
    names |= set(book.claims) | set(book.left) if book is not None else set()
    names |= {w for w in map(RunDir.writer_of_job, read_heartbeats(rd)) if w is not None}
    return {RunDir.writer_rank(w) for w in names}


def fleet_ids(rd: RunDir, n: int) -> list[int]:
    """The writer numbers of a fleet of ``n`` rollout jobs: those used and not drained first (a resume keeps its
    writers, with their claims and saved groups), then numbers never used. A fresh run gets ``0..n-1``."""
    drained = {RunDir.writer_rank(w) for w in drained_writers(rd)}
    used = used_writer_ids(rd)
    ids = sorted(used - drained)[:n]
    nxt = max(used, default=-1) + 1
    while len(ids) < n:
        ids.append(nxt)
        nxt += 1
    return ids


def retire_writers(rd: RunDir, keep: list[int], by: str, fleet: FleetLog) -> list[str]:
    """Before a resume (no job of the run is running): writers used, not drained and not in ``keep`` are drained
    and their claims released at once (each a ``drain_requested`` event in ``fleet``). Returns their names."""
    drained = drained_writers(rd)
    gone = [RunDir.writer_name(i) for i in sorted(used_writer_ids(rd) - set(keep))]
    gone = [w for w in gone if w not in drained]
    for w in gone:
        request_drain(rd, w, by)
        n = release_writer(rd, w, f"not in the resumed fleet ({by})")
        fleet.record(DRAIN_REQUESTED, writer=w, job=RunDir.rollout_job(w), by=by,
                     why="not in the resumed fleet: no job of it runs, its prompt claims handed back at once",
                     numbers={"released_prompts": n})
    return gone


def drain_newest(rd: RunDir, jobs: dict, count: int, by: str, emit: Callable[[str], None],
                 fleet: FleetLog) -> list[str]:
    """Drain the ``count`` newest rollout jobs among ``jobs`` (name -> handle) that are not draining already;
    cancel those still queued or starting (nothing to save) and release their claims; each step is an event in
    ``fleet``. Returns the job names."""
    drained = drained_writers(rd)
    active = sorted((RunDir.writer_rank(w), name) for name in jobs
                    if (w := RunDir.writer_of_job(name)) is not None and w not in drained)
    victims = [name for _, name in active[::-1][:count]]
    beats = read_heartbeats(rd)
    for name in victims:
        writer = RunDir.writer_of_job(name)
        request_drain(rd, writer, by)
        fleet.record(DRAIN_REQUESTED, writer=writer, job=name, job_id=jobs[name].job_id, by=by)
        beat = beats.get(name)
        if beat is None or beat.state == HeartbeatState.STARTING.value:
            jobs[name].cancel()
            fleet.record(CANCELLED, writer=writer, job=name, job_id=jobs[name].job_id, by=by,
                         why=f"drained while {'queued' if beat is None else 'starting'}: nothing to save")
            emit(f"scale: {name} ({jobs[name].job_id}) {'not started' if beat is None else 'starting'}: "
                 "nothing to save, cancelled")
        else:
            emit(f"scale: {name} ({jobs[name].job_id}) asked to drain: it finishes its groups in flight, seals, "
                 "hands back its budget and prompt claims and exits")
    return victims


def active_rollout_jobs(rd: RunDir, jobs: dict) -> list[str]:
    """Rollout jobs among ``jobs`` not asked to drain."""
    drained = drained_writers(rd)
    return [n for n in jobs if (w := RunDir.writer_of_job(n)) is not None and w not in drained]


def record_fleet_size(cfg: RunConfig, rd: RunDir, n: int, by: str) -> None:
    """``resources.rollout_jobs`` of the frozen config becomes ``n`` (a line in its history), so a resume starts
    this fleet."""
    old = cfg.resources.rollout_jobs
    if old == n:
        return
    cfg.resources.rollout_jobs = n
    rd.freeze_config(cfg, (f"resources.rollout_jobs: {old} -> {n} ({by})",))
