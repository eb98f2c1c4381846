"""Which rollout writers are gone for good: their claims are reclaimed by the writers that still run.

docs/weights-and-samples.md "Prompt claims". In a run no launcher follows (plain sbatch), a rollout job that dies
for good (scancel, a node failure, a time limit without requeue) would keep its open prompt claims and its
admission count forever: the fleet's budget shrinks by its groups in flight and their prompts are never generated.
So every writer, before it admits groups (``Admission.start``) and at most every :data:`CHECK_EVERY_S` seconds,
reads the heartbeats of the :data:`WATCHED` writers that follow it in the claim book, in a ring (w003 watches
w004, w005, w006; the last ones watch the first): every writer is watched by that many others, and a check costs
that many reads whatever the fleet's size (every writer reading every heartbeat was 768 x 768 reads per check
at 1,024 GPUs). A writer released by its watchers leaves the ring, so the next ones come into view. A writer is
*gone* when

- its heartbeat is older than ``timeouts.heartbeat_stale_s`` (nothing more is asked about a fresh one), and
- its job has ended: under Slurm (:attr:`~hpcrl.control.records.Heartbeat.slurm_job`) ``squeue`` says it is in an
  end state (:data:`ENDED_SLURM_STATES`) or no longer knows it; a job pending, requeued, running or in any other
  state is not gone (a requeued job comes back and recovers its claims itself), and an error or no answer from
  Slurm within :data:`SQUEUE_TIMEOUT_S` means "not gone" (logged). Outside Slurm the heartbeat must come from
  this host and its process must be gone; a job on another host without Slurm is never reclaimed by its
  heartbeat's age alone (said once in the log: a drain, or the launcher following the run, releases it).

A gone writer is released as a drained one is (``control/admission.py``, under the admission lock): its open
claims less what it committed go to the free list, its admission count drops to its committed groups, and the
claim book's ``left`` says who reclaimed it and why (``reclaimed by w000: heartbeat stale 312 s and Slurm job
123 ended (COMPLETED)``; ``hpcrl status`` shows it). Under the lock the writer's heartbeat is read again and must
be the one judged here: a new job of that writer beats before it joins, so one that came back meanwhile keeps its
claims. A writer that comes back after it was reclaimed joins with nothing of its own and drops the groups its
predecessor saved in flight (``rollout/in_flight.py``); a zombie of it (a process still alive after all) commits
nothing (``ClaimLost``).
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

from hpcrl.control.claims import ClaimBook
from hpcrl.control.records import Heartbeat
from hpcrl.rundir.fsio import read_json
from hpcrl.process.pids import pid_running
from hpcrl.process.squeue import squeue_states
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)

CHECK_EVERY_S = 5.0
"""How often a writer reads the heartbeats it watches (one small file each); half of
``timeouts.heartbeat_stale_s`` when that is shorter."""
WATCHED = 3
"""How many writers each writer watches (the next ones in the claim book's ring)."""
SLURM_RECHECK_S = 30.0
"""How long a writer waits before it asks Slurm again about a job that was not gone (or Slurm did not answer):
the rollout loop waits for ``squeue``, so a slow controller must not be asked every few seconds."""
SQUEUE_TIMEOUT_S = 10.0
"""Deadline of one ``squeue`` call; past it the job counts as not gone."""
ENDED_SLURM_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
"""``squeue`` states of a job that has ended and will not run again (a requeued job is PENDING or REQUEUED)."""


def slurm_state(job: str, timeout_s: float = SQUEUE_TIMEOUT_S) -> tuple[Optional[str], str]:
    """``(state, "")``, with state None when Slurm no longer knows the job, or ``(None, error)`` when Slurm could
    not tell (``process/squeue.py``)."""
    states, error = squeue_states([job], timeout_s)
    return (None, error) if states is None else (states.get(job), "")


@dataclass
class Verdict:
    """Whether a writer's job is gone (:func:`judge`), and why (or why not)."""

    gone: bool
    reason: str
    """What its job's end (or life) was seen by (``Slurm job 123 ended (COMPLETED)``); empty: the beat is fresh."""
    age_s: float
    asked_slurm: bool = False

    @property
    def why(self) -> str:
        """The line for the claim book's ``left`` and the logs."""
        return f"heartbeat stale {self.age_s:.0f} s {'and' if self.gone else 'but'} {self.reason}"


def judge(beat: Heartbeat, now_s: float, stale_s: float, host: str,
          ask_slurm: Callable[[str], tuple[Optional[str], str]] = slurm_state) -> Verdict:
    """The rule of the module docstring for the writer whose last beat is ``beat``, seen from ``host`` at
    ``now_s``. Asks Slurm (``ask_slurm``: :func:`slurm_state`) only about a stale beat."""
    age = beat.age_s(now_s)
    if age <= stale_s:
        return Verdict(False, "", age)
    if beat.slurm_job:
        state, error = ask_slurm(beat.slurm_job)
        if error:
            return Verdict(False, f"Slurm could not say whether job {beat.slurm_job} ended ({error}): not "
                                  "reclaimed", age, True)
        if state is None or state in ENDED_SLURM_STATES:
            return Verdict(True, f"Slurm job {beat.slurm_job} ended ({state or 'absent'})", age, True)
        return Verdict(False, f"Slurm job {beat.slurm_job} is {state}: not reclaimed (it comes back and recovers "
                              "its claims)", age, True)
    if beat.host != host:
        return Verdict(False, f"its heartbeat names no Slurm job and its host {beat.host} is not this one: never "
                              "reclaimed by a heartbeat's age alone (a drain, or the launcher following the run, "
                              "releases it)", age)
    if pid_running(beat.pid):
        return Verdict(False, f"its process {beat.pid} still runs on this host: not reclaimed", age)
    return Verdict(True, f"its process {beat.pid} on {beat.host} is gone", age)


def same_beat(run_dir: RunDir, writer: str, beat: Heartbeat) -> bool:
    """``writer``'s heartbeat on disk is still ``beat`` (no job of it beat since it was judged)."""
    try:
        now = Heartbeat.from_json(read_json(run_dir.heartbeat(RunDir.rollout_job(writer))))
    except (ValueError, OSError):
        return False
    return (now.host, now.pid, now.time_s) == (beat.host, beat.pid, beat.time_s)


class GoneWriters:
    """One writer's look at the others (module docstring): :meth:`find` when :meth:`due`."""

    def __init__(self, run_dir: RunDir, me: str, stale_s: float):
        self.run_dir = run_dir
        self.me = me
        self.stale_s = stale_s
        """``timeouts.heartbeat_stale_s``."""
        self.every_s = min(CHECK_EVERY_S, stale_s / 2)
        self._next_s = 0.0
        self._slurm_next_s: dict[str, float] = {}  # writer -> monotonic time before which Slurm is not asked again
        self._said: dict[str, str] = {}  # writer -> the last reason logged for not reclaiming it

    def due(self) -> bool:
        """True at most once per ``every_s`` (then :meth:`find` is expected)."""
        now = time.monotonic()
        if now < self._next_s:
            return False
        self._next_s = now + self.every_s
        return True

    def watched(self, book: ClaimBook) -> list[str]:
        """The :data:`WATCHED` writers after this one in ``book``'s ring (module docstring)."""
        ring = sorted(set(book.claims) | {self.me})
        at = ring.index(self.me)
        return [w for w in (ring[(at + i) % len(ring)] for i in range(1, WATCHED + 1)) if w != self.me][:WATCHED]

    def _beat(self, writer: str) -> Optional[Heartbeat]:
        try:
            d = read_json(self.run_dir.heartbeat(RunDir.rollout_job(writer)))
            return Heartbeat.from_json(d) if d is not None else None
        except (ValueError, OSError):  # not a record: it is rewritten every few seconds
            return None

    def find(self, book: ClaimBook) -> list[tuple[str, Heartbeat, str]]:
        """The writers this one watches whose jobs are gone: (writer, the beat judged, why). A writer without a
        heartbeat is never judged (nothing tells which job it was)."""
        now_s, host = time.time(), socket.gethostname()
        gone = []
        for writer in sorted(set(self.watched(book))):
            if time.monotonic() < self._slurm_next_s.get(writer, 0.0):
                continue
            beat = self._beat(writer)
            if beat is None:
                continue
            verdict = judge(beat, now_s, self.stale_s, host)
            if verdict.gone:
                gone.append((writer, beat, verdict.why))
                continue
            if verdict.asked_slurm:
                self._slurm_next_s[writer] = time.monotonic() + SLURM_RECHECK_S
            if verdict.reason and self._said.get(writer) != verdict.reason:
                log.info("writer %s: %s", writer, verdict.why)
            self._said[writer] = verdict.reason
        return gone
