"""The fleet's history: every change of the rollout fleet and every decision about it, as durable events.

A live run's fleet changes by requests (``hpcrl scale``, ``Run.scale``, ``resources.rollout_autoscale``) that the
launcher following the run turns into submissions and drain records, and by its jobs (a rollout job joins the
fleet, leaves it drained, is preempted and requeued, is killed and resubmitted). Each source appends what it did
to a file of its own in ``logs/fleet/`` (:meth:`~hpcrl.rundir.paths.RunDir.fleet_log`), one :class:`FleetEvent` a line:

=========================  ==========================================  ============================================
file                       written by (one process at a time)          events
=========================  ==========================================  ============================================
logs/fleet/launcher.jsonl  the launcher following the run (``hpcrl     ``submitted``, ``resubmitted``,
                           run``, a Python session's ``Run``)          ``cancelled``, ``left``, ``drain_requested``,
                                                                       ``scale_applied``, ``scale_refused``,
                                                                       ``autoscale``
logs/fleet/scale.jsonl     ``hpcrl scale`` (the request; and what it   ``scale_requested``, and without a launcher
                           did itself when no launcher acknowledged)   ``drain_requested``, ``submitted``,
                                                                       ``scale_applied``
logs/fleet/<writer>.jsonl  that writer's rollout job (``w000``)        ``joined`` (at its start, in
                                                                       ``control/admission.py``), ``ended`` (its
                                                                       final state: drained, preempted, stopped...)
=========================  ==========================================  ============================================

Read by ``hpcrl status`` and ``hpcrl report`` (``analysis/fleet.py``: who joined when, who left when and why,
groups/s per writer over time) and by users. Each line is appended and fsync'd at once (``fsio.JsonlAppender``):
a complete line is the commit point, a torn last line (a writer killed mid-append) is skipped by the readers.
A writer's file has one job of that writer at a time, except that a zombie predecessor (its lease taken over,
``control/claims.py``) may still write its ``ended`` after its successor's ``joined``: readers order every file by
``time_s``. Nothing here is read back by a job to decide anything: the records are the history, the control
records (``control/fleet.py``, ``admission.json``) are the state. The launcher's fleet path (``launcher/fleet.py``)
reads the ``submitted`` events: a submitted writer's number is used before its job starts (and, with no launcher
following the run, a queued job has no other record).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.rundir.fsio import JsonlAppender, read_jsonl
from hpcrl.control.records import slurm_job_of
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import FLEET_LAUNCHER, RunDir

log = logging.getLogger(__name__)

SCALE_REQUESTED = "scale_requested"
"""``hpcrl scale`` asked for ``to_jobs`` rollout jobs (``control/scale.json``)."""
SCALE_APPLIED = "scale_applied"
"""The fleet was changed from ``from_jobs`` to ``to_jobs`` rollout jobs (``by`` says who asked)."""
SCALE_REFUSED = "scale_refused"
"""A scale request the launcher could not apply (``why``)."""
AUTOSCALE = "autoscale"
"""A decision of ``resources.rollout_autoscale`` with its numbers; ``applied`` false when the queue check held it."""
SUBMITTED = "submitted"
"""A job was submitted (``job``, ``job_id``, ``writer``)."""
RESUBMITTED = "resubmitted"
"""A job that ended early was submitted again (``job_id`` the new one, ``numbers['previous_job_id']``)."""
CANCELLED = "cancelled"
"""A job was cancelled (a drained job still queued or starting: nothing to save)."""
LEFT = "left"
"""The launcher saw a drained rollout job end: it is not resubmitted (``why``: its final state)."""
DRAIN_REQUESTED = "drain_requested"
"""A drain record was written for ``writer``."""
JOINED = "joined"
"""A rollout job of ``writer`` took its lease and joined the fleet (``job_id``, ``host``, ``pid``)."""
ENDED = "ended"
"""A rollout job of ``writer`` ended (``why``: its final state: ``drained``, ``preempted``, ``stopped``, ``done``,
``failed``). A job killed by SIGKILL writes none: its next ``joined`` (or nothing) follows."""
EVENTS = (SCALE_REQUESTED, SCALE_APPLIED, SCALE_REFUSED, AUTOSCALE, SUBMITTED, RESUBMITTED, CANCELLED, LEFT,
          DRAIN_REQUESTED, JOINED, ENDED)


@dataclass
class FleetEvent(JsonRecord):
    """One line of a ``logs/fleet/*.jsonl`` file (module docstring)."""

    event: str
    """One of :data:`EVENTS`."""
    time_s: float
    """Unix time it happened."""
    source: str = FLEET_LAUNCHER
    """The file it is in: ``launcher``, ``scale`` or a writer name."""
    by: str = ""
    """Who asked, for requests and decisions (``hpcrl scale --rollout-jobs 3``, ``autoscale``, ``Run.scale``)."""
    job: str = ""
    """The job concerned (``rollout-w001``, ``trainer``), if any."""
    writer: str = ""
    """Its writer (``w001``), for rollout jobs."""
    job_id: str = ""
    """Its scheduler id (Slurm's job id, ``1234_5`` for an array task; the local process id), if known."""
    from_jobs: int = -1
    """Scale events: rollout jobs in the fleet before (-1: not a size change)."""
    to_jobs: int = -1
    """Scale events: rollout jobs asked for or after."""
    why: str = ""
    """The reason, in words (the autoscale rule's numbers; a final state; what the queue said)."""
    applied: bool = True
    """``autoscale``: the decision was carried out (false: held, ``why`` says why)."""
    numbers: dict = field(default_factory=dict)
    """The numbers behind a decision or event, by name with units (``trainer_idle_min``, ``start_in_s``)."""
    host: str = ""
    """``joined``: the node the job runs on."""
    pid: int = 0
    """``joined``: its process id."""


class FleetLog:
    """Appends :class:`FleetEvent` lines to one source's file; opened on the first event (a run whose fleet never
    changes writes only the launcher's ``submitted`` lines and each writer's ``joined``/``ended``)."""

    def __init__(self, run_dir: RunDir, source: str):
        self.path = run_dir.fleet_log(source)
        self.source = source
        self._out: Optional[JsonlAppender] = None

    def record(self, event: str, **fields) -> FleetEvent:
        """Append one event now (fsync'd); a filesystem error is logged, never raised: the history must not
        stop the fleet from changing."""
        assert event in EVENTS, event
        ev = FleetEvent(event, time.time(), self.source, **fields)
        try:
            if self._out is None:
                self._out = JsonlAppender(self.path)
            self._out.append(ev.to_json())
        except OSError as e:
            log.warning("could not append to %s (%s): %s", self.path, e, ev)
        return ev

    def close(self) -> None:
        """Close the file (a later :meth:`record` opens it again)."""
        if self._out is not None:
            self._out.close()
            self._out = None


def slurm_job_id() -> str:
    """This job's scheduler id, as the launcher names it: Slurm's (``1234_5`` for an array task), submitit's local
    job id, else ``local:<pid>``."""
    return slurm_job_of(dict(os.environ)) or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or f"local:{os.getpid()}"


def read_fleet_events(run_dir: RunDir) -> list[FleetEvent]:
    """Every complete event of every source, oldest first (a line that is not an event is skipped and logged)."""
    events = []
    for path in run_dir.fleet_logs():
        for d in read_jsonl(path):
            try:
                events.append(FleetEvent.from_json(d, str(path)))
            except ValueError as e:
                log.warning("%s: a line that is not a fleet event, skipped: %s", path, e)
    return sorted(events, key=lambda e: e.time_s)
