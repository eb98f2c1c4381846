"""Follow a submitted run from the login node: resubmit dead jobs, stop on a fatal input error, print
one line per weight version (:mod:`hpcrl.launcher.progress`).

Liveness comes from the job handles (process / squeue state) and from the run
directory's heartbeats, never from ``job.wait()`` (without accounting, submitit
cannot see a killed job's state and ``wait()`` never returns). Every wait here has a deadline.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from hpcrl.config import RunConfig
from hpcrl.control.fatal import read_fatal, read_fatal_record
from hpcrl.control.fleet import acknowledge_scale, read_scale_request
from hpcrl.control.fleet_log import RESUBMITTED, SCALE_REFUSED
from hpcrl.control.records import (HeartbeatState, read_heartbeats, read_latest_checkpoint, read_trainer_done,
                                   stop_requested)
from hpcrl.logs.eval_log import EVALUATED, JOB, EvalRow
from hpcrl.rundir.fsio import JsonlTail
from hpcrl.launcher.autoscale import Autoscaler
from hpcrl.launcher.fleet import Fleet, StartError
from hpcrl.launcher.progress import Console, hms
from hpcrl.launcher.reward_scale import resize_reward_jobs
from hpcrl.launcher.submit import LauncherJobs
from hpcrl.rundir.paths import EVAL_JOB, RunDir

log = logging.getLogger(__name__)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no file {path})"


def job_failure_report(rd: RunDir, handle) -> str:
    parts = [f"--- {rd.job_log(handle.name)} (last lines) ---", tail(rd.job_log(handle.name))]
    for path in handle.log_paths()[1:]:  # submitit's stderr of the job
        parts += [f"--- {path} (last lines) ---", tail(path)]
    return "\n".join(parts)


def eval_line(row: EvalRow) -> str:
    """The follower's line for one row of ``logs/eval.jsonl``."""
    if row.status != EVALUATED:
        return f"eval v{row.version} {row.status}: {row.reason}"
    score = f"{row.score:.3f}" if row.score is not None else "n/a"
    return (f"eval v{row.version} (step {row.trainer_step}): {row.score_name} {score} "
            f"({row.prompts} prompts x {row.n}, {row.eval_s:.1f}s)")


class RunFollower:
    """Follows a submitted run from the login node: prints one line per weight version and per
    evaluated version, resizes the rollout fleet when ``hpcrl scale`` asks and when ``resources.rollout_autoscale``
    decides (both through ``fleet``, ``launcher/fleet.py``; a drained rollout job is never resubmitted), resubmits
    jobs that end early (within ``resources.max_restarts``), warns on stale heartbeats, and stops at
    ``trainer_done`` (after the evaluation job, if any, has evaluated the final version) or its deadline. The
    evaluation job never stops the run: if it fails for good, training goes on without it.

    It calls ``jobs``, ``fleet``, ``autoscaler`` and ``console`` and none of them calls it back."""

    def __init__(self, rd: RunDir, cfg: RunConfig, jobs: LauncherJobs, fleet: Fleet, console: Console,
                 emit: Callable[[str], None], resume: bool = False, autoscaler: Optional[Autoscaler] = None):
        self.rd = rd
        self.cfg = cfg
        self.jobs = jobs
        """The jobs followed (``launcher/submit.py``): handles, plans, restarts."""
        self.fleet = fleet
        """The rollout fleet and its one resize path (its ``log`` is ``logs/fleet/launcher.jsonl``)."""
        self.autoscaler = autoscaler
        """``resources.rollout_autoscale``: decides fleet sizes from the idle ratios (``launcher/autoscale.py``)."""
        pending = read_scale_request(rd)
        self._scale_seen = pending.requested_s if pending is not None and pending.applied_s else 0.0
        self.emit = emit
        """Lines for the user (above the bar, when there is one)."""
        self._warned: dict[str, float] = {}
        self._beats_due_s = 0.0
        """When the heartbeats are read next for stale ones (:meth:`_warn_stale_heartbeats`)."""
        self._evals = JsonlTail(rd.eval_log)
        self._evals_seen = len(self._evals.poll()) if resume else 0
        self._started_s = time.monotonic()
        self.console = console
        """The version lines, problems, samples, start-up steps and the bar (:mod:`hpcrl.launcher.progress`)."""
        if resume:
            ckpt = read_latest_checkpoint(rd)
            self._intro = (f"resuming {rd.root}: trainer checkpoint at step {ckpt.step if ckpt else 0}/"
                           f"{cfg.total_updates} ({rd.latest_checkpoint if ckpt else 'none yet: from the start'}); "
                           f"only new updates are printed")
        else:
            self._intro = (f"jobs starting: each start-up step is shown below as it begins (`hpcrl status {rd.root}` "
                           f"shows them too); the trainer logs to {rd.job_log(RunDir.trainer_job())}")

    def _fix_hint(self) -> str:
        """How to go on after a fatal input error, by the input that failed."""
        record = read_fatal_record(self.rd)
        which = record.input if record is not None else ""
        resume = f"hpcrl run --resume --run-dir {self.rd.root}"
        if which == "reward":
            return f"fix the reward file, or point at another: `{resume} reward.path=FILE`"
        if which == "data":
            return f"fix the data file, or point at another: `{resume} data.source=FILE`"
        if which == "disk":
            return (f"free space on the run directory's filesystem (or raise the quota; `hpcrl status {self.rd.root}` "
                    f"shows its size and what is free), then `{resume}`")
        if which in ("model", "agent"):
            return (f"fix the {which} in place, then `{resume}` (a changed model.path cannot resume this run: "
                    "start a new --run-dir)")
        return f"fix it, then `{resume}` (with KEY=VALUE for what changed)"

    def _print_new_versions(self, every_log: bool = False) -> None:
        self.console.poll(every_log)

    def _print_new_evals(self) -> Optional[EvalRow]:
        """One line per new row of the evaluation job in ``logs/eval.jsonl``; the newest evaluated one so far."""
        rows = self._evals.poll()
        for d in rows[self._evals_seen:]:
            try:
                row = EvalRow.from_json(d)
            except ValueError:
                continue
            if row.source == JOB:
                self.emit(eval_line(row))
        self._evals_seen = len(rows)
        return self.last_eval()

    def last_eval(self) -> Optional[EvalRow]:
        """The evaluation job's newest evaluated row, or None."""
        for d in reversed(self._evals.rows):
            if d.get("status") == EVALUATED and d.get("source") == JOB:
                try:
                    return EvalRow.from_json(d)
                except ValueError:
                    continue
        return None

    def _restart(self, name: str, handle, why: str) -> bool:
        """Resubmit job ``name`` if its restart budget allows (True), saying why."""
        used = self.jobs.restarts.get(name, 0)
        if used >= self.cfg.resources.max_restarts:
            return False
        self.emit(f"job {name} ({handle.job_id}) {why}; resubmitting (restart {used + 1}/"
                  f"{self.cfg.resources.max_restarts}); last lines of its log:")
        self.emit(tail(self.rd.job_log(name), 5))
        new = self.jobs.resubmit(name)
        self.emit(f"job {name} resubmitted as {new.job_id}")
        beat = read_heartbeats(self.rd).get(name)
        self.fleet.log.record(RESUBMITTED, job=name, writer=RunDir.writer_of_job(name) or "", job_id=new.job_id,
                              why=f"{why}; its last heartbeat said {beat.state if beat else 'nothing (never started)'}",
                              numbers={"previous_job_id": handle.job_id, "restart": used + 1,
                                       "max_restarts": self.cfg.resources.max_restarts})
        return True

    def _give_up_eval(self, handle) -> None:
        """The evaluation job failed for good: say so; training goes on without it."""
        self.emit(f"the evaluation job ({handle.job_id}) failed and its restart budget (resources.max_restarts="
                  f"{self.cfg.resources.max_restarts}) is spent: training goes on without evaluation")
        self.emit(job_failure_report(self.rd, handle))
        self.jobs.forget(EVAL_JOB)

    def _check_jobs(self) -> Optional[int]:
        """Resubmit jobs that ended before the trainer finished, within the restart budget.
        Return 1 when the budget of some job is spent (after cancelling the rest), else None."""
        for name, handle in list(self.jobs.handles.items()):
            if not handle.done():
                continue
            if read_trainer_done(self.rd) is not None:
                return None
            if self.fleet.reap(name, handle) or self._reward_job_left(name, handle):  # drained: left the fleet
                continue
            if self._restart(name, handle, "ended before the trainer finished"):
                continue
            if name == EVAL_JOB:
                self._give_up_eval(handle)
                continue
            self.emit(f"job {name} ({handle.job_id}) ended before the trainer finished and its restart budget "
                      f"(resources.max_restarts={self.cfg.resources.max_restarts}) is spent: cancelling the run")
            self.emit(job_failure_report(self.rd, handle))
            self.end_all(0.0)
            return 1
        return None

    def _apply_scale_request(self) -> None:
        """Act on a new ``control/scale.json`` (``hpcrl scale``) and acknowledge it."""
        req = read_scale_request(self.rd)
        if req is None or req.requested_s <= self._scale_seen:
            return
        self._scale_seen = req.requested_s
        try:
            if req.rollout_jobs is not None:
                self.fleet.resize(req.rollout_jobs, req.by)
            if req.reward_jobs is not None:
                resize_reward_jobs(self.cfg, self.rd, req.reward_jobs, req.by, self.jobs.start_reward, self.emit)
        except (ValueError, OSError, StartError) as e:
            self.emit(f"scale request {self.rd.scale_request} not applied: {e}")
            self.fleet.log.record(SCALE_REFUSED, by=req.by, to_jobs=req.rollout_jobs or 0, why=str(e))
        acknowledge_scale(self.rd, req)

    def _reward_job_left(self, name: str, handle) -> bool:
        """A reward job that ended because the reward jobs were made fewer (``drained``) is not resubmitted."""
        beat = read_heartbeats(self.rd).get(name)
        if RunDir.reward_index(name) is None or beat is None or beat.state != HeartbeatState.DRAINED.value:
            return False
        self.emit(f"job {name} ({handle.job_id}) ended: the reward jobs are fewer now")
        self.jobs.forget(name)
        return True

    def _warn_stale_heartbeats(self) -> None:
        """Warn of a job whose heartbeat is older than ``timeouts.heartbeat_stale_s`` (once a minute per job). The
        heartbeats (one file per job) are read every quarter of that at most: a fleet of 768 is not 768 files read
        every poll, and a stale beat is said at most a quarter of its threshold late."""
        now = time.time()
        if now < self._beats_due_s:
            return
        self._beats_due_s = now + self.cfg.timeouts.heartbeat_stale_s / 4
        for job, beat in read_heartbeats(self.rd).items():
            age = beat.age_s(now)
            if not beat.ended and age > self.cfg.timeouts.heartbeat_stale_s and self._warned.get(job, 0) < now - 60:
                self._warned[job] = now
                self.emit(f"warning: {job} heartbeat is {age:.0f}s old (state {beat.state}); "
                          "it may be hung or its node unreachable")

    def follow(self, timeout_s: float, poll_s: float = 1.0) -> int:
        """Return 0 when the trainer finished, 1 on a failed job, the deadline or a stop request (Run.stop)."""
        deadline = time.monotonic() + timeout_s
        if self._intro:
            self.emit(self._intro)
            self._intro = ""
        while True:
            self._print_new_versions()
            self._print_new_evals()
            done = read_trainer_done(self.rd)
            if done is not None:
                self._finish_rollouts()
                self._print_new_versions(every_log=True)
                self._finish_eval(done.param_version, deadline, poll_s)
                self.jobs.end_all(60.0, log.info, self._reward_jobs())  # they end once no client is left
                last = self._print_new_evals()
                self.console.close()
                val = (f"; validation v{last.version} {last.score:.3f}" if last is not None and last.score is not None
                       else "")
                self.emit(f"run finished: {done.trainer_step} updates, version {done.param_version}, "
                          f"{done.consumed_groups} groups in {hms(time.monotonic() - self._started_s)}{val}; "
                          f"logs in {self.rd.logs}; next: hpcrl report {self.rd.root} --out {self.rd.report}, "
                          f"hpcrl samples {self.rd.root}, hpcrl export {self.rd.root} --out DIR")
                return 0
            fatal = read_fatal(self.rd)
            if fatal is not None:
                self.console.close()
                self.emit(f"run stopped: {fatal} (a restart would fail the same way; {self._fix_hint()})")
                self.end_all(self.cfg.timeouts.stop_s)  # each job stops by itself on the fatal record
                return 1
            if stop_requested(self.rd):  # Run.stop() from another thread (Ctrl-C in `hpcrl run` ends follow first)
                self.emit(f"run stopped on request ({self.rd.stop_request}); continue it with --resume")
                return 1
            self._apply_scale_request()
            if self.autoscaler is not None:
                self.autoscaler.step()
            failed = self._check_jobs()
            if failed is not None:
                return failed
            self._warn_stale_heartbeats()
            if time.monotonic() > deadline:
                self.emit(f"gave up after {timeout_s:.0f}s waiting for the trainer to finish "
                          f"(no {self.rd.trainer_done}); cancelling the run")
                self.end_all(0.0)
                return 1
            time.sleep(poll_s)

    def _finish_eval(self, final: int, deadline: float, poll_s: float) -> None:
        """The trainer is done: wait (until ``deadline``) for the evaluation job to evaluate the final version and
        end; resubmit it if it dies meanwhile (restart budget); cancel it at the deadline."""
        if EVAL_JOB not in self.jobs.handles:
            return
        self.emit(f"trainer done; waiting for the evaluation job to evaluate the final version v{final}")
        while True:
            self._print_new_evals()
            handle = self.jobs.handles[EVAL_JOB]
            if handle.done():
                beat = read_heartbeats(self.rd).get(EVAL_JOB)
                if beat is not None and beat.state == HeartbeatState.DONE.value:
                    return
                if not self._restart(EVAL_JOB, handle, "ended before it evaluated the final version"):
                    return self._give_up_eval(handle)
            elif time.monotonic() > deadline:
                self.emit("gave up waiting for the evaluation job (the follow deadline passed); cancelling it")
                self.end_all(0.0, [EVAL_JOB])
                return
            self._warn_stale_heartbeats()
            time.sleep(poll_s)

    def _finish_rollouts(self, grace_s: float = 60.0) -> None:
        """Rollout jobs stop on their own once trainer_done exists; give them ``grace_s``, then cancel. (The
        evaluation job is waited for by :meth:`_finish_eval`, the reward jobs, which may serve it, after it.)"""
        self.jobs.end_all(grace_s, log.info, [n for n in self.jobs.handles
                                              if n != EVAL_JOB and n not in self._reward_jobs()])

    def _reward_jobs(self) -> list[str]:
        """The reward jobs followed."""
        return [n for n in self.jobs.handles if RunDir.reward_index(n) is not None]

    def end_all(self, grace_s: float, names: Optional[list[str]] = None) -> None:
        """End the jobs (``LauncherJobs.end_all``: ``grace_s`` to stop by themselves, then cancelled) and wait
        until they are gone: a launcher that gives up leaves no job running behind it."""
        self.jobs.end_all(grace_s, self.emit, names)
