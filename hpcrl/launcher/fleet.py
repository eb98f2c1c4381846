"""The rollout fleet of a run: which writers are in it, which numbers new writers get, which writer drains, and
the one path that resizes it (:class:`Fleet`), whoever asks: ``Run.scale``, ``hpcrl scale`` through the launcher
following the run or by itself when none follows, and ``resources.rollout_autoscale``.

**Who is in the fleet** (:func:`active_writers`, the one rule every caller reads). A writer is in the fleet from the
moment a job of it is submitted until it leaves for good: it is drained (``control/drain/<writer>.json``, never
removed), or its job ended and nothing will start it again. A launcher follows its jobs by their handles and
resubmits every one that ends early, so there the fleet is the writers of its rollout jobs, less the drained.
Without a launcher the run directory says it: the writers it has a record of (a sample folder, a heartbeat,
prompt claims, a ``submitted`` event in ``logs/fleet/``, a drain record) and those the frozen config's fleet names
(a run launched by ``sbatch/submit.sh`` whose jobs are still queued), less the drained, those whose heartbeat
says their job ended (failed, stopped, done, drained: a *preempted* one is requeued by Slurm and stays) and those
the other writers found gone and reclaimed (the claim book's ``left``, ``control/reclaim.py``). A submitted job
that has not beaten yet is in the fleet (queued).

**Writer numbers** are never reused: a run launched with ``resources.rollout_jobs=N`` runs writers ``0..N-1``; a
resume keeps the writers used and not drained (with their claims and saved groups, :func:`fleet_ids`); a grown
fleet adds the next numbers above every number used or in the fleet (:func:`new_writer_ids`).

**Shrinking drains the newest writers** (:func:`drain_order`): each finishes its groups in flight, seals, hands
back its budget and prompt claims (``control/claims.py``) and exits 0, and the launcher never resubmits it. A job
still queued or starting when it is drained has nothing to save: a launcher cancels it and releases its claims
(from an earlier life, if any) when it sees the job end (:meth:`Fleet.reap`); without a launcher it drains at once
when it starts.

How a new writer's job is started is the caller's (:class:`Starter`): the launcher's executor
(``launcher/submit.py`` ``LauncherJobs``: submitit, one job per writer, cancellable) or, without a launcher,
sbatch's rollout job arrays (``launcher/scale_cmd.py``). Every step is a ``logs/fleet/`` event of the caller's
source and a line; ``resources.rollout_jobs`` in the frozen config follows the fleet (a line in its history), so
``--resume`` starts the fleet as it was.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

from hpcrl.config import RunConfig
from hpcrl.control.admission import read_claims, release_writer
from hpcrl.control.fleet import drain_requested, drained_writers, request_drain
from hpcrl.control.fleet_log import (CANCELLED, DRAIN_REQUESTED, LEFT, SCALE_APPLIED, SUBMITTED, FleetLog,
                                     read_fleet_events)
from hpcrl.control.records import HeartbeatState, read_heartbeats
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)


def _by_number(writers) -> list[str]:
    return sorted(set(writers), key=RunDir.writer_rank)


def _submitted_writers(rd: RunDir) -> set[str]:
    """Writers a ``submitted`` event of ``logs/fleet/`` names (its ``writer``, or an older ``hpcrl scale``'s
    ``numbers['writer_ids']`` of a job array)."""
    out = set()
    for e in read_fleet_events(rd):
        if e.event == SUBMITTED:
            out |= {e.writer} if e.writer else {RunDir.writer_name(int(i)) for i in e.numbers.get("writer_ids", ())}
    return out


def used_writer_ids(rd: RunDir) -> set[int]:
    """Writer numbers this run has used: sample folders, rollout heartbeats, drain records, prompt claims and the
    writers ``logs/fleet/`` says were submitted (a job still queued has used its number too)."""
    names = set(rd.writers()) | drained_writers(rd) | _submitted_writers(rd)
    book = read_claims(rd)
    names |= set(book.claims) | set(book.left) if book is not None else set()
    names |= {w for w in map(RunDir.writer_of_job, read_heartbeats(rd)) if w is not None}
    return {RunDir.writer_rank(w) for w in names}


def fleet_ids(rd: RunDir, n: int) -> list[int]:
    """The writer numbers of a launched or resumed fleet of ``n`` rollout jobs: those used and not drained first (a
    resume keeps its writers, with their claims and saved groups), then numbers never used. A fresh run gets
    ``0..n-1``."""
    drained = {RunDir.writer_rank(w) for w in drained_writers(rd)}
    used = used_writer_ids(rd)
    ids = sorted(used - drained)[:n]
    nxt = max(used, default=-1) + 1
    while len(ids) < n:
        ids.append(nxt)
        nxt += 1
    return ids


def new_writer_ids(rd: RunDir, count: int, active: list[str]) -> list[int]:
    """The numbers of ``count`` writers added to a live fleet whose writers are ``active``: above every number
    used or in the fleet, so none is ever run twice."""
    start = max(used_writer_ids(rd) | {RunDir.writer_rank(w) for w in active}, default=-1) + 1
    return list(range(start, start + count))


def drain_order(active: list[str], count: int) -> list[str]:
    """The ``count`` writers of ``active`` to drain when the fleet shrinks: the newest (highest numbers) first."""
    return _by_number(active)[::-1][:count]


def active_writers(rd: RunDir, cfg: RunConfig, handles: Optional[dict] = None) -> list[str]:
    """The writers in the fleet now (module docstring), by number: from the launcher's job ``handles`` (name ->
    handle; it resubmits every job it follows) or, without a launcher (None), from the run directory's records
    and ``cfg``'s ``resources.rollout_jobs``."""
    drained = drained_writers(rd)
    if handles is not None:
        return _by_number(w for name in handles if (w := RunDir.writer_of_job(name)) is not None and w not in drained)
    known = {RunDir.writer_name(i) for i in used_writer_ids(rd) | set(fleet_ids(rd, cfg.resources.rollout_jobs))}
    beats = read_heartbeats(rd)
    book = read_claims(rd)
    gone = set(book.left) if book is not None else set()
    return _by_number(w for w in known - drained - gone if _will_run(beats.get(RunDir.rollout_job(w))))


def _will_run(beat) -> bool:
    """A job of this writer runs, is queued (no heartbeat yet) or comes back (preempted: Slurm requeues it)."""
    return beat is None or not beat.ended or beat.state == HeartbeatState.PREEMPTED.value


def record_fleet_size(cfg: RunConfig, rd: RunDir, n: int, by: str) -> None:
    """``resources.rollout_jobs`` of the frozen config becomes ``n`` (a line in its history), so a resume starts
    this fleet."""
    old = cfg.resources.rollout_jobs
    if old == n:
        return
    cfg.resources.rollout_jobs = n
    rd.freeze_config(cfg, (f"resources.rollout_jobs: {old} -> {n} ({by})",))


class StartError(RuntimeError):
    """New writers' jobs could not be started (the message says why and what to do)."""


SBATCH_TIMEOUT_S = 60.0
"""How long one ``sbatch`` may take to answer before the start is refused."""


def submit_array(line: str) -> str:
    """Run one ``sbatch --parsable`` line (``shutil.which("sbatch")`` checked by the caller): the array's job id, or
    StartError naming the line and what went wrong."""
    import shlex
    import subprocess

    try:
        out = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StartError(f"`{line}` gave no answer in {SBATCH_TIMEOUT_S:g}s") from None
    if out.returncode != 0:
        raise StartError(f"`{line}` failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"


@dataclass
class Submitted:
    """One writer's job started by a :class:`Starter`."""

    writer: str
    job_id: str
    """The scheduler's id (``123``, ``4242_5`` for an array task, a local process id)."""
    how: str = ""
    """How, when it is not a job of its own (``rollout job array 4242: sbatch ...``)."""


class Starter(Protocol):
    """How a :class:`Fleet` starts and cancels writers' jobs: the launcher's executor, or sbatch without one."""

    kind: str
    """``local`` or ``slurm`` (a launcher's executor), ``sbatch`` (``hpcrl scale`` without a launcher)."""
    handles: Optional[dict]
    """The launcher's job handles by job name (trainer and evaluation included); None without a launcher."""
    note: str
    """Why-text for the fleet events (``no launcher follows the run``), or empty."""

    def start(self, writer_ids: list[int]) -> Iterator[Submitted]:
        """Start these writers' jobs, yielding each as it is submitted; StartError when one cannot be."""

    def cancel(self, job: str) -> bool:
        """Cancel this job (queued or starting: nothing to save); False if this starter cannot."""

    def forget(self, job: str) -> None:
        """Follow this job no more (it left the fleet)."""


class Fleet:
    """The rollout fleet of one run and the one way to resize it (module docstring). ``log`` is the caller's
    ``logs/fleet/`` source (the launcher's, or ``hpcrl scale``'s), ``emit`` its lines."""

    def __init__(self, rd: RunDir, cfg: RunConfig, log: FleetLog, emit: Callable[[str], None], starter: Starter):
        self.rd, self.cfg, self.log, self.emit, self.starter = rd, cfg, log, emit, starter

    def active(self) -> list[str]:
        """The writers in the fleet now (:func:`active_writers`)."""
        return active_writers(self.rd, self.cfg, self.starter.handles)

    def new_writer_ids(self, count: int) -> list[int]:
        """The numbers the next ``count`` writers would get."""
        return new_writer_ids(self.rd, count, self.active())

    def resize(self, rollout_jobs: int, by: str) -> list[str]:
        """Grow the fleet to ``rollout_jobs`` writers (new writers, which take the newest weights and claim prompts
        like the others) or shrink it (the newest drain); the frozen config follows. Returns the names of the jobs
        submitted or asked to drain. ValueError for fewer than one job; StartError (after recording the jobs that
        did start) when a new job cannot be started, and then the config is not changed."""
        if rollout_jobs < 1:
            raise ValueError(f"rollout_jobs must be >= 1, got {rollout_jobs}: a run needs one rollout job; stop the "
                             "run instead (Run.stop(), Ctrl-C in `hpcrl run`, or scancel its jobs)")
        active = self.active()
        changed: list[str] = []
        if rollout_jobs > len(active):
            changed = self._grow(self.new_writer_ids(rollout_jobs - len(active)), by)
        elif rollout_jobs < len(active):
            changed = self._drain(drain_order(active, len(active) - rollout_jobs), by)
        record_fleet_size(self.cfg, self.rd, rollout_jobs, by)
        self.emit(f"scale: the rollout fleet goes from {len(active)} to {rollout_jobs} job(s) ({by})")
        self.log.record(SCALE_APPLIED, by=by, from_jobs=len(active), to_jobs=rollout_jobs, why=self.starter.note,
                        numbers={"jobs": changed})
        return changed

    def _grow(self, ids: list[int], by: str) -> list[str]:
        started, said = [], ""
        for s in self.starter.start(ids):
            job = RunDir.rollout_job(s.writer)
            if s.how and s.how != said:
                self.emit(f"scale: {s.how}")
                said = s.how
            self.emit(f"scale: {job} submitted as {s.job_id} ({by})")
            self.log.record(SUBMITTED, job=job, writer=s.writer, job_id=s.job_id, by=by, why=s.how)
            started.append(job)
        return started

    def _job_id(self, job: str, beat) -> str:
        handle = (self.starter.handles or {}).get(job)
        return handle.job_id if handle is not None else (beat.slurm_job if beat is not None else "")

    def _drain(self, writers: list[str], by: str) -> list[str]:
        """Write the drain records of ``writers``; cancel those still queued or starting where the starter can."""
        beats = read_heartbeats(self.rd)
        jobs = []
        for writer in writers:
            job = RunDir.rollout_job(writer)
            beat = beats.get(job)
            job_id = self._job_id(job, beat)
            named = f"{job} ({job_id})" if job_id else job
            request_drain(self.rd, writer, by)
            self.log.record(DRAIN_REQUESTED, writer=writer, job=job, job_id=job_id, by=by, why=self.starter.note)
            unstarted = beat is None or beat.state == HeartbeatState.STARTING.value
            if unstarted and self.starter.cancel(job):
                self.log.record(CANCELLED, writer=writer, job=job, job_id=job_id, by=by,
                                why=f"drained while {'queued' if beat is None else 'starting'}: nothing to save")
                self.emit(f"scale: {named} {'not started' if beat is None else 'starting'}: nothing to save, "
                          "cancelled")
            elif beat is None:
                self.emit(f"scale: {named} not started yet, asked to drain: it leaves the fleet as soon as it starts")
            else:
                self.emit(f"scale: {named} asked to drain: it finishes its groups in flight, seals, hands back its "
                          "budget and prompt claims and exits")
            jobs.append(job)
        return jobs

    def retire(self, keep: list[int], by: str) -> list[str]:
        """Before a resume (no job of the run is running): writers used, not drained and not in ``keep`` are drained
        and their claims released at once (each a ``drain_requested`` event). Returns their names."""
        drained = drained_writers(self.rd)
        gone = [w for w in _by_number(map(RunDir.writer_name, used_writer_ids(self.rd) - set(keep)))
                if w not in drained]
        for w in gone:
            request_drain(self.rd, w, by)
            n = release_writer(self.rd, w, f"not in the resumed fleet ({by})")
            self.log.record(DRAIN_REQUESTED, writer=w, job=RunDir.rollout_job(w), by=by,
                            why="not in the resumed fleet: no job of it runs, its prompt claims handed back at once",
                            numbers={"released_prompts": n})
        return gone

    def reap(self, job: str, handle) -> bool:
        """The launcher saw ``job`` end: if its writer was drained it left the fleet (True): it is not resubmitted
        and its claims are released if it could not release them itself (killed while draining, or cancelled
        before it started). False for any other job."""
        writer = RunDir.writer_of_job(job)
        if writer is None or not drain_requested(self.rd, writer):
            return False
        beat = read_heartbeats(self.rd).get(job)
        released = release_writer(self.rd, writer, "drained: its job ended")
        self.emit(f"job {job} ({handle.job_id}) left the fleet ({beat.state if beat else 'never started'}"
                  f"{f'; {released} prompt claims handed back by the launcher' if released else ''})")
        self.log.record(LEFT, job=job, writer=writer, job_id=handle.job_id,
                        why=beat.state if beat else "never started", numbers={"released_prompts": released})
        self.starter.forget(job)
        return True
