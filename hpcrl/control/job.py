"""Every job's life, written once: the trainer, rollout and evaluation jobs keep only their own steps.

:func:`job_main` is what a job's entry point does before its loop, in this order:

1. **logging** into ``RUN/logs/jobs/<job>.log`` with the job in the prefix (``[simulated]`` for a simulated run);
2. **leftovers**: mark this process as the run's job and end the processes of an earlier attempt of the same job
   on this node (``process/leftovers.py``);
3. **signals**: SIGTERM stops the job at once (``process/termination.py``); USR2 asks it to stop at its next safe
   point (``process/preemption.py``);
4. the job's own object is built, then :func:`run` is its whole life.

:func:`run` is the frame around a job's own steps (:class:`Steps`):

- ``start()``: its start-up steps (``control/startup.py``: named, bounded, in the heartbeat);
- ``loop()``: its loop, until it returns the :class:`Stop` that ended it, or raises :class:`Stopping` from deep
  inside a unit of work (the evaluation job between two prompts);
- ``shutdown(final_state)``: save what must be saved and release what it holds, whatever stage failed (nothing
  built yet included), with SIGTERM deferred (a second SIGTERM, which ``srun`` forwards from Slurm, must not cut
  the save short);
- then, in this order: the **final heartbeat** (``done``, ``stopped``, ``preempted``, ``drained``, ``failed``),
  and only after it the **requeue** of a preempted job: a requeue that works kills the process at once, so a job
  that requeued before saying ``preempted`` would read as a stale, still-working job.

Why a job ends (one type, :class:`Stop`): its work is over (``done``), USR2 or a Slurm preemption's SIGTERM
(``preempted``: save, requeue), the launcher's stop request or another job's fatal record (``stopped``: Ctrl-C, or
an input no restart can fix, ``control/fatal.py``; save; a ``--resume`` continues: after a full disk's record the
save does not wait for space again), or a drain request for a rollout writer (``drained``: finish, hand back, leave
for good). :class:`StopWatch` is
how a loop asks, between two units of work: SIGTERM first (it raises), then USR2, then the run directory's records:
when ``control/changes.jsonl`` grew (``control/changes.py``: every writer of a stop, drain or done record appends
to it), or, for a job without one, at most every :data:`POLL_S`. Any other exception is a failure: logged with its trace into the
job's log (where the launcher looks), except :class:`CannotStart`, which is one line and exit status 1.

**A full disk** (``disk.guarded``): every write waits for space up to ``timeouts.disk_full_s`` (set here, with
``timeouts.slow_write_s``, for the whole process). A job holds a little room on the run directory's filesystem
while it lives (``control/reserve/<job>``); when a write gives up (:class:`hpcrl.rundir.disk.WriteFailed`) it gives the
room back, so its fatal record (``control/fatal.json``, input ``disk``: the launcher stops the run instead of
resubmitting it into the same wall, ``hpcrl status`` says "disk full at ...") and its last heartbeat can still be
written; its shutdown then saves what fits without waiting again.
"""
from __future__ import annotations

import enum
import logging
import os
import time
from typing import Callable, Optional, Protocol

from hpcrl.rundir import disk
from hpcrl.control.changes import ChangeWatch
from hpcrl.control.fatal import read_fatal, read_fatal_record, write_fatal
from hpcrl.control.fleet import drain_requested
from hpcrl.control.records import HeartbeatState, stop_requested
from hpcrl.logs.run_logs import setup_logging
from hpcrl.process import termination
from hpcrl.process.leftovers import mark_job, sweep_leftovers
from hpcrl.process.preemption import PreemptionFlag, preempted_by_slurm, requeue_self
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a job looks at the run directory's stop records (one stat of the shared filesystem each; ending
half a second late costs nothing)."""
RESERVE_BYTES = 1 << 20
"""Room a job holds for its last records (a fatal record and a heartbeat are a few hundred bytes each)."""


class Stop(str, enum.Enum):
    """Why a job ends without failing; the value is the final heartbeat's state."""

    DONE = HeartbeatState.DONE.value
    """Its work is over: the trainer finished (``control/trainer_done.json``), every due version evaluated."""
    PREEMPTED = HeartbeatState.PREEMPTED.value
    """USR2 (a preemption or the time limit ahead), or the SIGTERM of a Slurm preemption: save, then requeue."""
    STOPPED = HeartbeatState.STOPPED.value
    """The launcher asked the run to stop (``control/stop.json``, Ctrl-C), or a job recorded an error no restart can
    fix (``control/fatal.json``): save; a ``--resume`` continues."""
    DRAINED = HeartbeatState.DRAINED.value
    """A rollout writer asked to leave the fleet (``control/drain/<writer>.json``): finish, hand back, leave."""

    @property
    def state(self) -> HeartbeatState:
        return HeartbeatState(self.value)


class Stopping(Exception):
    """Raised from inside a unit of work when the job must end for ``reason`` (caught by :func:`run`)."""

    def __init__(self, reason: Stop):
        super().__init__(reason.value)
        self.reason = reason


class CannotStart(Exception):
    """The job cannot start for a reason one line says (e.g. the trainer's world cannot form): no trace, exit 1."""


class StopWatch:
    """What a job's loop asks between units of work: must it end, and why? ``actions``: what the job does for each
    reason, said in the one line that names the reason (a callable is asked at that moment); ``trainer_done``:
    this job ends when the trainer is done (a rollout job); ``writer``: this job is that rollout writer (it may be
    drained); ``changes``: the job's watch of ``control/changes.jsonl`` (the records are looked at only when it
    reports a change; without one, every :data:`POLL_S`)."""

    def __init__(self, run_dir: RunDir, preemption: Optional[PreemptionFlag],
                 actions: dict[Stop, str | Callable[[], str]], trainer_done: bool = False,
                 writer: Optional[str] = None, changes: Optional[ChangeWatch] = None):
        self.run_dir, self.preemption, self.actions = run_dir, preemption, actions
        self.trainer_done, self.writer, self.changes = trainer_done, writer, changes
        self._looked_s = 0.0
        self.seen: Optional[Stop] = None
        """The reason found (kept: a stop is not taken back)."""
        self._fatal: Optional[str] = None
        """The other job's fatal error, when that is what stopped this one."""

    def check(self) -> Optional[Stop]:
        """SIGTERM raises SystemExit; else the reason to end now, or None. The reason is said once."""
        termination.check()
        if self.seen is None:
            self.seen = self._look()
            if self.seen is not None:
                action = self.actions.get(self.seen, "stopping")
                (log.info if self.seen == Stop.DONE else log.warning)(
                    "%s: %s", self.describe(self.seen), action() if callable(action) else action)
        return self.seen

    def raise_if_asked(self) -> None:
        """:meth:`check`, raising :class:`Stopping` (for a job that stops from inside a unit of work)."""
        reason = self.check()
        if reason is not None:
            raise Stopping(reason)

    def _look(self) -> Optional[Stop]:
        if self.preemption is not None and self.preemption.requested:
            return Stop.PREEMPTED
        if self.changes is not None:
            if not self.changes.changed("stop"):
                return None
        else:
            now = time.monotonic()
            if now - self._looked_s < POLL_S:
                return None
            self._looked_s = now
        if self.trainer_done and self.run_dir.trainer_done.exists():
            return Stop.DONE
        if stop_requested(self.run_dir):
            return Stop.STOPPED
        self._fatal = read_fatal(self.run_dir)
        if self._fatal is not None:
            record = read_fatal_record(self.run_dir)
            if record is not None and record.input == "disk":  # it stayed full past disk_full_s: save what fits now
                disk.POLICY.full_wait_s = 0.0
            return Stop.STOPPED
        if self.writer is not None and drain_requested(self.run_dir, self.writer):
            return Stop.DRAINED
        return None

    def describe(self, reason: Stop) -> str:
        """What asked the job to end, in words."""
        return {Stop.PREEMPTED: "USR2",  # a preemption, or the time limit ahead (submitit's --signal)
                Stop.DONE: "the trainer is done",
                Stop.STOPPED: (f"the run stopped on an error no restart can fix ({self._fatal}; to go on, fix it, then "
                               f"`hpcrl run --resume --run-dir {self.run_dir.root}`, or remove {self.run_dir.fatal} "
                               "before submitting the sbatch scripts again)" if self._fatal
                               else f"stop requested by the launcher ({self.run_dir.stop_request})"),
                Stop.DRAINED: f"asked to leave the fleet ({self.run_dir.drain_request(self.writer or '')})"}[reason]


class Steps(Protocol):
    """A job's own steps, framed by :func:`run` (module docstring)."""

    name: str
    """The job's name in log lines (``trainer``, ``rollout w000``, ``evaluation job``)."""
    heartbeat: object
    """Its heartbeat (``start``, ``stop(final_state)``); a stand-in on ranks that do not beat."""
    requeues: bool
    """Whether this process asks Slurm to requeue the job when preempted (one process per job does)."""

    def start(self) -> None:
        """The job's start-up steps (named and bounded: ``control/startup.py``)."""

    def loop(self) -> Stop:
        """The job's loop until it must end; the reason (or :class:`Stopping` raised from inside it)."""

    def shutdown(self, final_state: HeartbeatState) -> None:
        """Save what must be saved and release what it holds, whatever stage failed (SIGTERM deferred)."""


class DiskRoom:
    """The room a job holds on the run directory's filesystem (module docstring)."""

    def __init__(self, run_dir: RunDir, job: str):
        self.run_dir, self.job, self.path = run_dir, job, run_dir.disk_reserve(job)

    def hold(self) -> None:
        """Take :data:`RESERVE_BYTES` (said in one line if there is no room even for that)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("no room for the job's reserve %s (%s): a full disk may leave its last records unwritten",
                        self.path, e.strerror)

    def give_back(self) -> None:
        """Free the room (at every end of the job, and before its fatal record)."""
        self.path.unlink(missing_ok=True)

    def record(self, failed: disk.WriteFailed) -> None:
        """The run cannot go on: give the room back, then the fatal record; later writes do not wait again."""
        self.give_back()
        disk.POLICY.full_wait_s = 0.0
        try:
            write_fatal(self.run_dir, self.job, str(failed), "disk")
        except (OSError, disk.WriteFailed) as e:
            log.error("could not record the failure in %s either (%s)", self.run_dir.fatal, e)


def run(job: Steps, room: Optional[DiskRoom] = None) -> None:
    """A job's whole life (module docstring): start, loop, then shutdown, final heartbeat and requeue in that order,
    whatever happened. Raises what ended the job if it failed (SystemExit for SIGTERM, a full disk, CannotStart)."""
    job.heartbeat.start()
    final_state = HeartbeatState.FAILED
    try:
        job.start()
        final_state = job.loop().state
    except Stopping as stop:
        final_state = stop.reason.state
    except CannotStart as e:
        log.error("%s cannot start: %s", job.name, e)
        raise SystemExit(1) from None
    except disk.WriteFailed as e:
        log.error("%s cannot go on: %s (free space, then `hpcrl run --resume`)", job.name, e)
        if room is not None:
            room.record(e)
        raise SystemExit(1) from None
    except BaseException as e:
        if isinstance(e, SystemExit) and termination.received() is not None and preempted_by_slurm():
            log.warning("SIGTERM of a Slurm preemption: saving what the job must save, then requeueing")
            final_state = HeartbeatState.PREEMPTED
        elif not isinstance(e, SystemExit):
            log.exception("%s failed", job.name)  # into RUN/logs/jobs/, where the launcher looks
        raise
    finally:
        with termination.deferred():
            try:
                _shut_down(job, final_state, room)
            finally:
                job.heartbeat.stop(final_state)
                if room is not None:
                    room.give_back()
                if final_state == HeartbeatState.PREEMPTED and job.requeues:
                    requeue_self()  # under Slurm; elsewhere whoever started the job restarts it


def _shut_down(job: Steps, final_state: HeartbeatState, room: Optional[DiskRoom]) -> None:
    """``job.shutdown``; a write it cannot make on a full disk ends the job as failed with the fatal record."""
    try:
        job.shutdown(final_state)
    except disk.WriteFailed as e:
        log.error("%s could not save what it holds: %s", job.name, e)
        if room is not None:
            room.record(e)
        raise SystemExit(1) from None


def job_main(run_dir: str, job: str, command: tuple[str, ...], build: Callable[[RunDir, PreemptionFlag], Steps],
             log_name: Optional[str] = None) -> None:
    """A job's entry point (module docstring): ``job`` is its name in the run directory (``trainer``,
    ``rollout-w000``, ``eval``), ``command`` the words of its command line after ``hpcrl`` (an earlier attempt's
    processes are found by them), ``log_name`` its log's name if not ``job`` (a trainer rank's)."""
    rd = RunDir(run_dir)
    cfg = rd.load_config()
    name = log_name or job
    tag = " [sizing probe]" if cfg.is_sizing_probe else " [simulated]" if cfg.is_simulated else ""
    setup_logging(name + tag, cfg.logging.level, rd.job_log(name))
    disk.POLICY.full_wait_s, disk.POLICY.slow_write_s = cfg.timeouts.disk_full_s, cfg.timeouts.slow_write_s
    mark_job(rd.root, job)
    sweep_leftovers(rd.root, job, command)
    termination.install()
    preemption = PreemptionFlag()
    try:
        steps = build(rd, preemption)
    except CannotStart as e:  # one line, naming what was missing
        log.error("%s cannot start: %s", name, e)
        raise SystemExit(1) from None
    room = DiskRoom(rd, name)
    room.hold()
    run(steps, room)
