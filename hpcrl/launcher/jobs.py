"""Job handles the launcher can trust without accounting.

submitit reads job state from ``sacct``; on clusters without accounting (and on
the private test cluster) that state is ``UNKNOWN`` forever and ``job.wait()``
never returns for a killed job (seen with Debian's slurm-wlm 22.05 without
accounting: ``sacct`` fails and the state reads ``UNKNOWN``). So Slurm jobs are followed with
``squeue`` (while queued or running, requeued included) and ``scontrol show job``
(for ``MinJobAge`` seconds after the end), and local jobs with their process.

A local job is cancelled as ``scancel`` cancels a Slurm job: SIGTERM, then SIGKILL to the job and everything it
started once it is still running :data:`KILL_WAIT_S` later (looked at whenever ``done()`` is asked). The SIGTERM
alone can be lost: submitit's controller forwards it only to a task it has started, and submitit's wrapper
ignores it ("Bypassing signal SIGTERM") until the job installs its own handler. Seen in CI: a job cancelled
within a second of its submission ran on.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

from hpcrl.process.reaper import descendants
from hpcrl.process.squeue import squeue_states

log = logging.getLogger(__name__)

# squeue/scontrol states in which a job is still coming or running
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}

KILL_WAIT_S = 30.0
"""Seconds from a local job's SIGTERM to its SIGKILL: Slurm's default ``KillWait``."""


QUEUE_REFRESH_S = 2.0
"""How old a launcher's view of the Slurm queue may be: its jobs are asked about together at most this often."""
SLURM_TIMEOUT_S = 30.0
"""Deadline of one ``squeue`` or ``scontrol`` call; past it the jobs asked about read ``UNREACHABLE``."""
UNREACHABLE = "UNREACHABLE"
"""The state of a job while Slurm does not answer (not ended: it is asked again)."""


class SlurmQueue:
    """What Slurm says of a launcher's jobs, asked for all of them at once: one ``squeue -h -j ID,ID,... -o "%i %T"``
    at most every ``refresh_s``, where asking job by job cost a launcher following 768 rollout jobs 768 ``squeue``
    calls per poll of its run (seconds to minutes of a busy controller's time, every second). A job the queue no
    longer lists is asked once with ``scontrol show job`` (it ended less than ``MinJobAge`` ago, or the controller
    forgot it), and its end is final: Slurm keeps a requeued job in the queue (``REQUEUED``, then ``PENDING``), so a
    job that left it does not come back. While Slurm does not answer, the jobs read :data:`UNREACHABLE` (logged) and
    are asked again at the next refresh. Thread-safe (``Run.stop`` may ask while the follower does)."""

    def __init__(self, refresh_s: float = QUEUE_REFRESH_S):
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._states: dict[str, str] = {}
        """The last answer for each job still in the queue (or not yet asked about)."""
        self._ended: dict[str, Optional[str]] = {}
        """The jobs that left the queue, with their end state (None: Slurm no longer knows the job)."""
        self._asked_s = -math.inf

    def add(self, job_id: str) -> None:
        """Ask about ``job_id`` too from the next refresh on (which comes at the next question)."""
        with self._lock:
            if job_id not in self._ended:
                self._states.setdefault(job_id, UNREACHABLE)
                self._asked_s = -math.inf

    def state(self, job_id: str) -> Optional[str]:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ..., :data:`UNREACHABLE`); None when Slurm no
        longer knows it."""
        with self._lock:
            if job_id in self._ended:
                return self._ended[job_id]
            if job_id not in self._states or time.monotonic() - self._asked_s >= self.refresh_s:
                self._states.setdefault(job_id, UNREACHABLE)
                self._refresh()
            return self._ended[job_id] if job_id in self._ended else self._states[job_id]

    def _refresh(self) -> None:
        """One ``squeue`` for every job in the queue; ``scontrol`` for each one it no longer lists."""
        self._asked_s = time.monotonic()
        ids = sorted(self._states)
        listed = _squeue(ids)
        if listed is None:
            self._states = dict.fromkeys(ids, UNREACHABLE)
            return
        for job_id in ids:
            state = listed.get(job_id) or _scontrol_state(job_id)
            if state in ACTIVE_STATES or state == UNREACHABLE:
                self._states[job_id] = state
            else:
                del self._states[job_id]
                self._ended[job_id] = state


def _squeue(job_ids: list[str]) -> Optional[dict[str, str]]:
    """``{job id: state}`` of the jobs the queue lists (None: Slurm did not answer, logged)."""
    states, error = squeue_states(job_ids, SLURM_TIMEOUT_S)
    if states is None:
        log.warning("could not ask Slurm about jobs %s: %s", ",".join(job_ids), error)
    return states


def _scontrol_state(job_id: str) -> Optional[str]:
    """``scontrol show job``'s JobState for a job the queue no longer lists; None when Slurm forgot the job."""
    try:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                             timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not ask Slurm about job %s: %s", job_id, e)
        return UNREACHABLE
    for token in out.stdout.split():
        if token.startswith("JobState="):
            return token.split("=", 1)[1]
    return None


class JobHandle:
    """One submitted job: ``done()``, ``state()``, ``cancel()``, ``log_paths()``."""

    def __init__(self, name: str, job, kind: str, kill_wait_s: float = KILL_WAIT_S):
        self.name = name
        self.job = job  # a submitit Job
        self.kind = kind
        self.kill_wait_s = kill_wait_s
        self.queue = SlurmQueue()
        """Where a Slurm job's state is asked (a launcher shares one among all its jobs: ``LauncherJobs``)."""
        self._cancelled_at: Optional[float] = None  # a local job: when its SIGTERM was sent
        self._killed = False

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def state(self) -> str:
        if self.kind == "local":
            return "FINISHED" if self.job.done() else "RUNNING"
        return self.queue.state(self.job_id) or "GONE"

    def done(self) -> bool:
        if self.kind == "local":
            if self.job.done():
                return True
            self._kill_after_kill_wait()
            return False
        st = self.state()
        return st not in ACTIVE_STATES and st != UNREACHABLE

    def cancel(self) -> None:
        try:
            if self.kind == "local":
                # SIGTERM to submitit's controller, which forwards it to the job: the job stops cleanly
                # (job.cancel() sends SIGINT, which the jobs ignore, see submit._sigint_ignored)
                process = getattr(self.job, "_process", None)
                if process is not None and process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    self._cancelled_at = self._cancelled_at or time.monotonic()
                else:
                    self.job.cancel(check=False)
            else:
                subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)
        except Exception as e:  # cancelling is best effort; say so
            log.warning("could not cancel %s (%s): %s", self.name, self.job_id, e)

    def _kill_after_kill_wait(self) -> None:
        """A local job still running :data:`KILL_WAIT_S` after its SIGTERM: SIGKILL it, its tasks first."""
        if self._cancelled_at is None or self._killed or time.monotonic() - self._cancelled_at < self.kill_wait_s:
            return
        self._killed = True
        controller = self.job._process
        tree = [pid for pid, _ in descendants(controller.pid)] + [controller.pid]
        log.warning("%s (%s) still running %.0fs after its SIGTERM; SIGKILL to its %d processes, as Slurm does after "
                    "KillWait", self.name, self.job_id, self.kill_wait_s, len(tree))
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # ended meanwhile
                pass

    def log_paths(self) -> list[Path]:
        """submitit's stdout and stderr files of this job ([] if submitit cannot name them: logged)."""
        try:
            return [Path(self.job.paths.stdout), Path(self.job.paths.stderr)]
        except (AttributeError, OSError, ValueError) as e:  # no paths for this kind of job, or a job id it cannot parse
            log.warning("no submitit log paths for %s (%s): %s", self.name, self.job_id, e)
            return []
