"""Small JSON control records in ``RUN/control/`` (each written tmp -> fsync -> replace).

=====================================  ===========  ======================================
record                                 written by   read by
=====================================  ===========  ======================================
heartbeat/<job>.json  (Heartbeat)      every job    launcher, trainer (waiting), retention, rollout jobs (reclaim.py)
loading/<reader>.json (LoadingAnn.)    every reader trainer weight retention (rollout jobs, eval)
checkpoints/latest.json (LatestCkpt.)  trainer      trainer (resume), launcher (--resume)
trainer_done.json     (TrainerDone)    trainer      rollout jobs (stop), evaluation job (final version), launcher
admission.json        (AdmissionRecord) rollout job  rollout jobs (see admission.py)
skipped_shards.jsonl  (SkippedShard)   trainer      rollout jobs, trainer (samples/skips.py)
stop.json             (StopRequest)    launcher     every job (checkpoint / seal, then stop)
drain/<writer>.json   (DrainRequest)   launcher     that rollout job, launcher (see fleet.py)
scale.json            (ScaleRequest)   hpcrl scale  launcher (see fleet.py)
=====================================  ===========  ======================================
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.control.changes import bump
from hpcrl.process import termination
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.disk import WriteFailed, make_dirs
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)


class HeartbeatState(str, enum.Enum):
    """What a job is doing, as written in its heartbeat (the JSON holds the plain string)."""

    STARTING = "starting"
    GENERATING = "generating"            # rollout: groups in flight
    WAITING_WEIGHTS = "waiting_weights"  # rollout: budget spent, waiting for a newer version
    TRAINING = "training"                # trainer: inside an update
    WAITING_SAMPLES = "waiting_samples"  # trainer: waiting for committed groups
    EVALUATING = "evaluating"            # evaluation job: a version is being evaluated
    SERVING = "serving"                  # reward job: its model answers requests
    DONE = "done"                        # ended normally (trainer finished / rollout told to stop)
    FAILED = "failed"                    # ended by an exception
    STOPPED = "stopped"                  # ended by SIGTERM (scancel, the launcher's cancel, Ctrl-C)
    PREEMPTED = "preempted"              # ended on USR2 to be requeued (a new life beats again)
    DRAINED = "drained"                  # rollout: left the fleet for good (control/drain/<writer>.json)

    def __str__(self) -> str:
        return self.value


ENDED_STATES = frozenset({HeartbeatState.DONE.value, HeartbeatState.FAILED.value, HeartbeatState.PREEMPTED.value,
                          HeartbeatState.STOPPED.value, HeartbeatState.DRAINED.value})
"""States in which a job's process has ended: its heartbeat is not expected to move, and
it pins nothing (weight retention), whatever the heartbeat's age."""


def slurm_job_of(env: dict[str, str]) -> str:
    """The Slurm job of a process with environment ``env`` as ``squeue -j`` takes it (:attr:`Heartbeat.slurm_job`):
    ``ARRAYJOB_TASK`` for an array task (requeued, it keeps that name), else ``SLURM_JOB_ID``; empty outside Slurm."""
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID", "")


def has_ended(state: object) -> bool:
    """True if a heartbeat's ``state`` field says its job has ended."""
    return str(state) in ENDED_STATES


@dataclass
class JobStats(JsonRecord):
    """A heartbeat's counters, written by the job through this type and read by ``hpcrl status`` (the evaluation
    job's line), ``Run.status()`` and the tests. Each job kind writes its own fields; the others stay None and are
    left out of the JSON."""

    step: Optional[int] = None
    """Trainer: local updates done."""
    consumed_groups: Optional[int] = None
    """Trainer: groups consumed so far."""
    reward_mean: Optional[float] = None
    """Trainer: mean reward of the last update's groups."""
    idle_ratio: Optional[float] = None
    """Trainer: share of the last update's wall time spent waiting for samples. Reward job: share of its serving
    time its model was not computing."""
    items_scored: Optional[int] = None
    """Reward job: responses scored (and free prompts answered) so far."""
    groups_committed: Optional[int] = None
    """Rollout: groups this writer has committed (its manifest)."""
    last_version: Optional[int] = None
    """Evaluation: the last version it evaluated (None: none yet; -1 in a beat of an older hpcrl)."""
    score: Optional[float] = None
    """Evaluation: that version's score (``score_name``)."""
    score_name: Optional[str] = None
    """Evaluation: what ``score`` is (``val-core/<source>/reward/mean@n``)."""
    evaluating: Optional[int] = None
    """Evaluation: the version being evaluated now (None: none; -1 in a beat of an older hpcrl)."""
    prompts_done: Optional[int] = None
    """Evaluation: held-out prompts of ``evaluating`` scored so far."""
    prompts: Optional[int] = None
    """Evaluation: held-out prompts per version."""
    skipped: Optional[int] = None
    """Evaluation: due versions it skipped (it fell behind, or they were deleted before it got to them)."""

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def evaluating_now(self) -> Optional[int]:
        """The version the evaluation job is evaluating, or None (an older hpcrl wrote -1 for none)."""
        return self.evaluating if self.evaluating is not None and self.evaluating >= 0 else None


@dataclass
class Heartbeat(JsonRecord):
    """One job's liveness record, ``control/heartbeat/<job>.json``; rewritten every few seconds."""

    job: str
    """Job name from :class:`~hpcrl.rundir.paths.RunDir` (``trainer``, ``rollout-w000``, ...)."""
    role: str
    """``trainer``, ``rollout`` or ``eval``."""
    host: str
    """Host name the job runs on (``hpcrl status`` checks the pid there)."""
    pid: int
    time_s: float
    """Unix time of this beat; older than timeouts.heartbeat_stale_s = dead."""
    param_version: int = -1
    """Trainer: newest published version. Rollout: version it generates with. Evaluation: last version evaluated."""
    state: str = HeartbeatState.STARTING.value
    """A :class:`HeartbeatState` value."""
    step: str = ""
    """While ``starting``: the start-up step running (``building DeepSpeed's ops``, ``starting the vllm engine``);
    after it, the step it failed in, if it failed there."""
    step_started_s: float = 0.0
    """Unix time the step began."""
    stats: JobStats = field(default_factory=JobStats)
    """The job's counters (:class:`JobStats`: groups committed or consumed, idle ratio, what it evaluates)."""
    slurm_job: str = ""
    """The Slurm job that runs it, as ``squeue -j`` takes it (``123``, or ``120_3`` for an array task); empty
    outside Slurm (and in a beat written before the field existed). Other rollout jobs ask Slurm about it before
    they reclaim a dead writer's claims (``control/reclaim.py``)."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["state"] = str(self.state)
        d["stats"] = self.stats.to_json()
        return d

    @property
    def ended(self) -> bool:
        """Its job's process has ended (the beat is not expected to move)."""
        return has_ended(self.state)

    def age_s(self, now_s: float) -> float:
        """Seconds since this beat was written."""
        return now_s - self.time_s


@dataclass
class LoadingAnnouncement(JsonRecord):
    """``control/loading/<reader>.json``: which weight version a reader (rollout job, evaluation) is reading."""

    writer: str
    """The reader's name (a rollout job's writer name, ``eval``); a pin counts while a job of that name beats."""
    version: int
    state: str
    """``loading`` pins the version against deletion; ``loaded`` releases it."""
    time_s: float


@dataclass
class TrainerDone(JsonRecord):
    """``control/trainer_done.json``: the trainer finished; rollout jobs stop, the evaluation job evaluates
    ``param_version`` (the final version) and stops, the launcher reports."""

    trainer_step: int
    param_version: int
    consumed_groups: int
    time_s: float
    cursor: dict = field(default_factory=dict)
    """Final sample cursor: every committed group before it was consumed, none after."""


@dataclass
class FilteredGroups(JsonRecord):
    """``control/filtered_groups.json``: how many committed groups the trainer's dynamic sampling
    (``algorithm.filter_groups``) has found without spread: dropped (consumed, never trained), so the rollout fleet's
    admission gives back the places they held (``control/admission.py``). Written by trainer rank 0 (tmp -> rename)
    whenever it drops one and at its start; read by every rollout job before it starts a group.

    The count is the trainer's: after a restart it falls back to its checkpoint's and climbs again as the same
    groups are dropped again, so it never counts a group that was not dropped, and it may lag behind (less budget
    for a moment, never more)."""

    groups: int
    """Groups dropped so far: those of completed updates (the checkpointed counter) plus those of the update the
    trainer is gathering."""
    time_s: float


def read_filtered_groups(run_dir: RunDir) -> int:
    """:class:`FilteredGroups`' count; 0 before the trainer wrote one (or for a damaged record: less budget, never
    more)."""
    try:
        d = read_json(run_dir.filtered_groups)
        return FilteredGroups.from_json(d).groups if d is not None else 0
    except (ValueError, OSError):
        return 0


@dataclass
class LatestCheckpoint(JsonRecord):
    """``checkpoints/latest.json``: the newest complete checkpoint. Written by trainer rank 0 after every
    rank saved it; read by the trainer at resume and by the launcher (``--resume`` says where it starts)."""

    tag: str
    """Folder name of the checkpoint in ``checkpoints/`` (``step-00000040``)."""
    step: int
    """Local updates done at that checkpoint."""


@dataclass
class StopRequest(JsonRecord):
    """``control/stop.json``: the launcher asks every job to stop (Ctrl-C or SIGTERM to ``hpcrl run``). The trainer
    finishes the update it is in, checkpoints it (as on USR2, without a requeue) and ends ``stopped``; a rollout
    job seals its complete groups, saves those in flight and ends ``stopped``. Written by the launcher,
    removed by ``hpcrl run --resume``; read by every job at its safe points."""

    requested_s: float
    """Unix time of the request."""
    by: str
    """Who asked and why, for the logs (``hpcrl run: Ctrl-C``)."""


def request_stop(run_dir: RunDir, by: str) -> None:
    """Ask every job of the run to stop at its next safe point (trainer: after a checkpoint)."""
    run_dir.control.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir.stop_request, StopRequest(time.time(), by).to_json())
    bump(run_dir, "stop requested", by)


def stop_requested(run_dir: RunDir) -> bool:
    """A stop was asked for (one stat of the shared filesystem)."""
    return run_dir.stop_request.exists()


def clear_stop(run_dir: RunDir) -> None:
    """Forget a stop request (``--resume``)."""
    run_dir.stop_request.unlink(missing_ok=True)


def ended_state(state: str) -> str:
    """The state a job ends in: one that "failed" because SIGTERM stopped it (scancel, the launcher's cancel) is
    ``stopped``: it was cancelled, nothing went wrong; a job that stopped itself for a reason did fail."""
    if state == HeartbeatState.FAILED and termination.received() is not None and termination.failure_reason() is None:
        return HeartbeatState.STOPPED.value
    return str(state)


def read_latest_checkpoint(run_dir: RunDir) -> Optional[LatestCheckpoint]:
    """The newest checkpoint's record; None if there is none yet. ValueError (naming the file) if it is
    not one: the trainer must not start over silently when its checkpoint record is damaged."""
    d = read_json(run_dir.latest_checkpoint)
    if d is None:
        return None
    try:
        return LatestCheckpoint.from_json(d)
    except ValueError as e:
        raise ValueError(f"{run_dir.latest_checkpoint} is not a checkpoint record ({e}); restore it, or remove it "
                         "to start the run over") from None


def read_heartbeats(run_dir: RunDir) -> dict[str, Heartbeat]:
    """Heartbeat records by job name. One that cannot be read (not JSON, not a heartbeat, written by
    something else) is left out: it is rewritten every few seconds."""
    out = {}
    folder = run_dir.heartbeats
    if folder.is_dir():
        for p in sorted(folder.glob("*.json")):
            try:
                beat = Heartbeat.from_json(read_json(p))
            except (ValueError, OSError):  # RecordError is a ValueError
                continue
            out[beat.job] = beat
    return out


def read_trainer_done(run_dir: RunDir) -> Optional[TrainerDone]:
    """The trainer's final record; None until it is written (or if it is not one: logged by the caller's
    wait, never trusted)."""
    try:
        return TrainerDone.from_json(read_json(run_dir.trainer_done)) if run_dir.trainer_done.exists() else None
    except (ValueError, OSError):
        return None


def live_jobs(run_dir: RunDir, heartbeat_stale_s: float) -> set[str]:
    """Writers/jobs whose heartbeat is fresh. Rollout jobs are keyed by writer name too."""
    now = time.time()
    alive = set()
    for job, beat in read_heartbeats(run_dir).items():
        if beat.age_s(now) <= heartbeat_stale_s and not beat.ended:
            alive.add(job)
            writer = RunDir.writer_of_job(job)
            if writer is not None:
                alive.add(writer)
    return alive


def describe_heartbeats(run_dir: RunDir, role: Optional[str] = None) -> str:
    """One line for wait messages: each job, its state and its heartbeat age."""
    now = time.time()
    parts = [f"{job}: {b.state} v{b.param_version} heartbeat {b.age_s(now):.0f}s ago"
             for job, b in read_heartbeats(run_dir).items() if role is None or b.role == role]
    return f"run dir {run_dir.root}; " + ("; ".join(parts) if parts else f"no {role or 'job'} heartbeat yet")


class HeartbeatThread:
    """Rewrites ``control/heartbeat/<job>.json`` every ``interval_s`` from a daemon thread.

    The owner updates ``state``, ``param_version`` and ``stats``; a crash stops the
    beats, and readers see the heartbeat age grow past ``heartbeat_stale_s``.
    """

    def __init__(self, run_dir: RunDir, job: str, role: str, interval_s: float):
        self.path = run_dir.heartbeat(job)
        make_dirs(self.path.parent)
        self.beat = Heartbeat(job=job, role=role, host=socket.gethostname(), pid=os.getpid(), time_s=time.time(),
                              slurm_job=slurm_job_of(dict(os.environ)))
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._failed_said_s = -60.0
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job}", daemon=True)

    def start(self) -> "HeartbeatThread":
        """Write the first beat now, then beat from the thread."""
        self.write()
        self._thread.start()
        return self

    def update(self, **fields) -> None:
        """Change fields of the record; the next beat writes them."""
        with self._lock:
            for k, v in fields.items():
                setattr(self.beat, k, v)

    def write(self) -> None:
        """Write the record now (tmp -> fsync -> replace); the job's thread and the beat's write one at a time, so
        an older beat never lands after a newer one."""
        with self._write_lock:
            with self._lock:
                self.beat.time_s = time.time()
                record = self.beat.to_json()
            try:
                write_json_atomic(self.path, record, wait=False)
            except (OSError, WriteFailed) as e:  # a beat must never stop the job: the next one tries again
                now = time.monotonic()
                if now - self._failed_said_s >= 60.0:
                    self._failed_said_s = now
                    log.warning("heartbeat %s not written (%s): its age grows until a beat is written again",
                                self.path, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def stop(self, final_state: str) -> None:
        """Stop beating and write the final state (done, failed, preempted; a job that "failed"
        because SIGTERM stopped it is ``stopped``: it was cancelled, nothing went wrong)."""
        final_state = ended_state(final_state)
        self._stop.set()
        self._thread.join(timeout=5)
        self.update(state=final_state)
        self.write()
