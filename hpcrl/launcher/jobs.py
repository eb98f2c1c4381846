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
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

from hpcrl.process.reaper import descendants

log = logging.getLogger(__name__)

# squeue/scontrol states in which a job is still coming or running
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}

KILL_WAIT_S = 30.0
"""Seconds from a local job's SIGTERM to its SIGKILL: Slurm's default ``KillWait``."""


def slurm_state(job_id: str) -> Optional[str]:
    """The job's state from squeue, else scontrol; None if Slurm no longer knows it."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        for token in out.stdout.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not query Slurm for job %s: %s", job_id, e)
        return "UNREACHABLE"
    return None


class JobHandle:
    """One submitted job: ``done()``, ``state()``, ``cancel()``, ``log_paths()``."""

    def __init__(self, name: str, job, kind: str, kill_wait_s: float = KILL_WAIT_S):
        self.name = name
        self.job = job  # a submitit Job
        self.kind = kind
        self.kill_wait_s = kill_wait_s
        self._cancelled_at: Optional[float] = None  # a local job: when its SIGTERM was sent
        self._killed = False

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def state(self) -> str:
        if self.kind == "local":
            return "FINISHED" if self.job.done() else "RUNNING"
        return slurm_state(self.job_id) or "GONE"

    def done(self) -> bool:
        if self.kind == "local":
            if self.job.done():
                return True
            self._kill_after_kill_wait()
            return False
        st = self.state()
        return st not in ACTIVE_STATES and st != "UNREACHABLE"

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
