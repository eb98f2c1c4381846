"""Job handles the launcher can trust without accounting.

submitit reads job state from ``sacct``; on clusters without accounting (and on
the private test cluster) that state is ``UNKNOWN`` forever and ``job.wait()``
never returns for a killed job (seen with Debian's slurm-wlm 22.05 without
accounting: ``sacct`` fails and the state reads ``UNKNOWN``). So Slurm jobs are followed with
``squeue`` (while queued or running, requeued included) and ``scontrol show job``
(for ``MinJobAge`` seconds after the end), and local jobs with their process.
"""
from __future__ import annotations

import logging
import signal
import subprocess
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# squeue/scontrol states in which a job is still coming or running
ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


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

    def __init__(self, name: str, job, kind: str):
        self.name = name
        self.job = job  # a submitit Job
        self.kind = kind

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def state(self) -> str:
        if self.kind == "local":
            return "FINISHED" if self.job.done() else "RUNNING"
        return slurm_state(self.job_id) or "GONE"

    def done(self) -> bool:
        if self.kind == "local":
            return self.job.done()
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
                else:
                    self.job.cancel(check=False)
            else:
                subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)
        except Exception as e:  # cancelling is best effort; say so
            log.warning("could not cancel %s (%s): %s", self.name, self.job_id, e)

    def log_paths(self) -> list[Path]:
        """submitit's stdout and stderr files of this job ([] if submitit cannot name them: logged)."""
        try:
            return [Path(self.job.paths.stdout), Path(self.job.paths.stderr)]
        except (AttributeError, OSError, ValueError) as e:  # no paths for this kind of job, or a job id it cannot parse
            log.warning("no submitit log paths for %s (%s): %s", self.name, self.job_id, e)
            return []
