"""Preemption and time limits: USR2 means "checkpoint at the next safe point, then requeue".

Slurm sends USR2 ``signal_delay_s`` before the time limit (``--signal=USR2@90``)
or on preemption; ``scancel --signal=USR2 JOB`` does the same by hand. The
handler only sets a flag: the job checks it between units of work (a trainer
update, a rollout group), where its state is consistent, saves what it must and
calls :func:`requeue_self`. Doing the work inside the signal handler (submitit's
default) could checkpoint a half-applied optimizer step.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)


class PreemptionFlag:
    """Set by USR2; the job checks ``requested`` at its next safe point."""

    def __init__(self, signum: int = signal.SIGUSR2):
        self.requested = False
        signal.signal(signum, self._handler)  # replaces submitit's handler in this process

    def _handler(self, signum, frame) -> None:
        if not self.requested:
            log.warning("received %s: will checkpoint at the next safe point and requeue", signal.Signals(signum).name)
        self.requested = True


def requeue_self() -> bool:
    """Ask Slurm to requeue this job (it keeps its id; the run resumes when it restarts).

    Returns False outside Slurm: then whoever started the job restarts it (the
    launcher's restart budget), and it resumes from the checkpoint just written.
    """
    job = os.environ.get("SLURM_JOB_ID")  # an array task has its own job id too
    if not job:
        log.warning("preempted outside Slurm: exiting; start the job again to resume")
        return False
    # Said before the call: a successful requeue kills this process at once, often before
    # scontrol returns, so a line written afterwards is lost on a busy node.
    log.warning("requeueing Slurm job %s; it resumes from the checkpoint when it starts again", job)
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        log.error("scontrol requeue %s failed (%s); the launcher must resubmit this job", job, out.stderr.strip())
        return False
    return True


def preempted_by_slurm() -> bool:
    """This Slurm job was selected for preemption (``scontrol show job`` gives it a ``PreemptTime``). Slurm sends
    SIGTERM at the start of the partition's GraceTime and requeues the job at its end only if it is still running:
    a job that saves and exits within the grace is merely complete, so it must requeue itself
    (:func:`requeue_self`). False outside Slurm, or when scontrol cannot say (logged)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not ask Slurm whether job %s is preempted (%s): treating SIGTERM as a cancel", job, e)
        return False
    for token in out.stdout.split():
        if token.startswith("PreemptTime="):
            return token.split("=", 1)[1] not in ("None", "Unknown", "")
    return False
