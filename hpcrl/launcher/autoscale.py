"""Opt-in autoscaling of the rollout fleet (``resources.rollout_autoscale``), run by the launcher following the run.

The rule, on the measured idle ratios of the last ``versions`` weight versions:

- the trainer waited for samples more than ``idle_ratio`` of each of its last ``versions`` updates
  (``trainer/idle_ratio``), and the fleet is below ``max_jobs``: add one rollout job;
- every rollout job was idle more than ``idle_ratio`` over those versions (``rollouter/idle_ratio``, the mean of
  its rows), the trainer was not, and the fleet is above ``min_jobs``: drain the newest one (the fleet is ahead of
  the trainer, or waits on the admission budget);
- otherwise nothing. After a decision the rule waits ``versions`` more versions (the new job starts, the drained
  one leaves, the ratios settle).

:func:`decide` is the rule alone (rows in, a decision with its numbers out); :class:`Autoscaler` feeds it the
run's logs and the launcher's fleet (``launcher/fleet.py``: the writers in it; a decision resizes it through
``Fleet.resize``, the path ``hpcrl scale`` takes). Before a job is *added* under Slurm the queue must be able to
start one soon (:func:`queue_verdict`, also pure): no rollout job of the fleet is still pending (one that is
would only be joined by another in the queue), and ``sbatch --test-only`` with the rollout job's options
(:func:`sbatch_test_only`, a subprocess with a deadline; its answer parsed by :func:`parse_test_only`) expects a
start within ``start_within_s``. Otherwise the decision is held: logged with the queue's answer, and the rule
waits ``versions`` versions as after any decision. The local executor can always start one. Draining needs no
check.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Optional

from hpcrl.logs import metric_names as M
from hpcrl.config.resources import RolloutAutoscale
from hpcrl.control.fleet_log import AUTOSCALE
from hpcrl.rundir.fsio import JsonlTail
from hpcrl.launcher.fleet import Fleet
from hpcrl.launcher.sbatch_lines import test_only_argv
from hpcrl.rundir.paths import RunDir


@dataclass
class Decision:
    """A change of the fleet size and why, with the numbers."""

    rollout_jobs: int
    why: str
    version: int
    """The newest trainer version the rule saw."""
    numbers: dict = field(default_factory=dict)
    """The numbers the rule read (``trainer_idle_min``, ``rollout_idle`` per writer, ...), for the fleet log."""


def decide(cfg: RolloutAutoscale, jobs: int, trainer_rows: list[dict], rollout_rows: dict[str, list[dict]],
           last_decision_version: int) -> Optional[Decision]:
    """The rule of the module docstring: ``jobs`` is the fleet size now, ``trainer_rows`` the metrics rows so far,
    ``rollout_rows`` each writer's rows (the writers of the current fleet)."""
    if not trainer_rows:
        return None
    version = int(trainer_rows[-1].get(M.PARAM_VERSION, len(trainer_rows)))
    recent = trainer_rows[-cfg.versions:]
    if len(recent) < cfg.versions or version - last_decision_version < cfg.versions:
        return None
    trainer_idle = [float(r.get(M.TRAINER_IDLE_RATIO, 0.0)) for r in recent]
    since = int(recent[0].get(M.PARAM_VERSION, 0))
    numbers = {"trainer_idle_min": min(trainer_idle), "trainer_idle_max": max(trainer_idle),
               "idle_ratio": cfg.idle_ratio, "since_version": since, "jobs": jobs}
    if min(trainer_idle) > cfg.idle_ratio and jobs < cfg.max_jobs:
        return Decision(jobs + 1, f"trainer idle {min(trainer_idle):.2f}-{max(trainer_idle):.2f} > "
                                  f"{cfg.idle_ratio:g} in each of the last {cfg.versions} updates", version, numbers)
    per_writer = {}
    for writer, rows in rollout_rows.items():
        ratios = [float(r.get(M.ROLLOUT_IDLE_RATIO, 0.0)) for r in rows if int(r.get(M.PARAM_VERSION, -1)) >= since]
        if ratios:
            per_writer[writer] = sum(ratios) / len(ratios)
    if (len(per_writer) == jobs and per_writer and min(per_writer.values()) > cfg.idle_ratio
            and max(trainer_idle) <= cfg.idle_ratio and jobs > cfg.min_jobs):
        shown = ", ".join(f"{w} {v:.2f}" for w, v in sorted(per_writer.items()))
        return Decision(jobs - 1, f"every rollout job idle > {cfg.idle_ratio:g} since version {since} ({shown}) "
                                  f"while the trainer was busy (idle <= {max(trainer_idle):.2f})", version,
                        {**numbers, "rollout_idle": per_writer})
    return None


@dataclass
class TestOnly:
    """What ``sbatch --test-only`` answered: Slurm's ``Job 123 to start at 2026-11-24T14:00:00 using 1
    processors on nodes n1 in partition debug`` (stderr; ``in partition`` since Slurm 18.08)."""

    start_s: float
    """Unix time the job would start (the controller's estimate given the queue now)."""
    processors: int
    nodes: str
    partition: str = ""


_TEST_ONLY = re.compile(r"Job \d+ to start at (\S+) using (\d+) processors on (?:nodes )?(\S+)(?: in partition (\S+))?")


def parse_test_only(text: str) -> Optional[TestOnly]:
    """The estimate in ``sbatch --test-only``'s output (its time in ``SLURM_TIME_FORMAT=standard``, local time),
    None if the output holds none (an error, another format)."""
    m = _TEST_ONLY.search(text)
    if m is None:
        return None
    try:
        start = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None
    return TestOnly(start, int(m.group(2)), m.group(3), m.group(4) or "")


def queue_verdict(pending: list[str], test: "TestOnly | str | None", now_s: float,
                  start_within_s: float) -> tuple[bool, str, dict]:
    """Can the queue start an added rollout job soon? ``pending``: the fleet's jobs still pending (``name (id)``);
    ``test``: ``sbatch --test-only``'s estimate, or why there is none (a string), or None (not asked: the local
    executor). Returns (yes or no, the reason in words, its numbers)."""
    if pending:
        return False, (f"{', '.join(pending)} still pending in the queue: another job would only wait beside it"), \
            {"pending_jobs": len(pending)}
    if test is None:
        return True, "local executor: a job starts at once", {}
    if isinstance(test, str):
        return False, f"sbatch --test-only gave no start time ({test})", {}
    start_in = test.start_s - now_s
    nums = {"start_in_s": round(start_in, 1), "start_within_s": start_within_s}
    where = f" on {test.nodes}" + (f" in partition {test.partition}" if test.partition else "")
    if start_in <= start_within_s:
        return True, f"sbatch --test-only: it would start in {max(start_in, 0):.0f}s{where}", nums
    return False, (f"sbatch --test-only: it would start only in {start_in:.0f}s{where} "
                   f"(> resources.rollout_autoscale.start_within_s={start_within_s:g})"), nums


TEST_ONLY_TIMEOUT_S = 30.0
"""Deadline of one ``sbatch --test-only`` (the controller answers in well under a second when it is up)."""


def sbatch_test_only(argv: list[str], timeout_s: float = TEST_ONLY_TIMEOUT_S) -> "TestOnly | str":
    """Run ``argv`` (an sbatch line with ``--test-only``) within ``timeout_s``: its estimate, or why none."""
    env = {**os.environ, "SLURM_TIME_FORMAT": "standard"}  # ISO times whatever the user's setting
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s:g}s"
    except OSError as e:
        return str(e)
    text = out.stderr + out.stdout
    found = parse_test_only(text)
    if found is None:
        lines = [x for x in text.strip().splitlines() if x.strip()]
        return f"exit {out.returncode}: {lines[-1] if lines else 'no output'}"
    return found


def can_start_soon(handles: list, test_argv: Optional[list[str]], start_within_s: float) -> tuple[bool, str, dict]:
    """The queue check for adding a job: ``handles`` the fleet's rollout jobs (``JobHandle``: a pending one holds
    it), ``test_argv`` the ``sbatch --test-only`` line of the job to add (None: local executor)."""
    pending = [f"{h.name} ({h.job_id})" for h in handles if h.kind != "local" and h.state() == "PENDING"]
    test = None if test_argv is None or pending else sbatch_test_only(test_argv)
    return queue_verdict(pending, test, time.time(), start_within_s)


QueueCheck = Callable[[], "tuple[bool, str, dict]"]
"""Can the queue start another rollout job soon: (yes or no, the reason in words, its numbers)."""


def fleet_queue_check(fleet: Fleet, start_within_s: float) -> QueueCheck:
    """The queue check of a launcher's fleet (:func:`can_start_soon`): its rollout jobs' handles, and ``sbatch
    --test-only`` with the options of the next writer's job (none for the local executor)."""
    def check() -> tuple[bool, str, dict]:
        handles = [fleet.starter.handles[RunDir.rollout_job(w)] for w in fleet.active()]
        argv = None if fleet.starter.kind == "local" else test_only_argv(fleet.cfg, fleet.rd, sys.executable,
                                                                          fleet.new_writer_ids(1)[0])
        return can_start_soon(handles, argv, start_within_s)
    return check


class Autoscaler:
    """Applies the rule to a launcher's fleet: reads the run's logs for :func:`decide`, remembers its last decision,
    logs each decision (a line and an ``autoscale`` event with its numbers and, to add a job, the queue's answer)
    and resizes the fleet through :meth:`Fleet.resize <hpcrl.launcher.fleet.Fleet.resize>` unless the queue holds
    it. ``queue_check`` defaults to :func:`fleet_queue_check`."""

    def __init__(self, fleet: Fleet, cfg: RolloutAutoscale, queue_check: Optional[QueueCheck] = None):
        self.fleet = fleet
        self.rd = fleet.rd
        self.cfg = cfg
        self.queue_check = queue_check or fleet_queue_check(fleet, cfg.start_within_s)
        self._metrics = JsonlTail(self.rd.metrics)
        self._rollout: dict[str, JsonlTail] = {}
        self.last_version = -10**9
        """The trainer version of the last decision (the rule waits ``versions`` after it)."""

    def poll(self, writers: list[str]) -> Optional[Decision]:
        """A decision for a fleet of ``writers`` (those running and not draining), or None."""
        for writer, path in self.rd.rollout_metrics_logs().items():
            self._rollout.setdefault(writer, JsonlTail(path))
        rows = {w: self._rollout[w].poll() for w in writers if w in self._rollout}
        decision = decide(self.cfg, len(writers), self._metrics.poll(), rows, self.last_version)
        if decision is not None:
            self.last_version = decision.version
        return decision

    def step(self) -> Optional[Decision]:
        """One step of the rule on the fleet now; the decision taken (applied or held), or None."""
        writers = self.fleet.active()
        decision = self.poll(writers)
        if decision is None:
            return None
        ok, queue, numbers = True, "", dict(decision.numbers)
        if decision.rollout_jobs > len(writers):
            ok, queue, said = self.queue_check()
            numbers.update(said)
        why = decision.why + (f"; queue: {queue}" if queue else "")
        self.fleet.emit(f"autoscale: {len(writers)} -> {decision.rollout_jobs} rollout job(s) at version "
                        f"{decision.version}: {why}" + ("" if ok else f"; held until {self.cfg.versions} more "
                                                       "versions have passed"))
        self.fleet.log.record(AUTOSCALE, by=AUTOSCALE, from_jobs=len(writers), to_jobs=decision.rollout_jobs,
                              why=why, applied=ok, numbers={"version": decision.version, **numbers})
        if ok:
            self.fleet.resize(decision.rollout_jobs, AUTOSCALE)
        return decision
