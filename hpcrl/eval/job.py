"""The evaluation job (``hpcrl eval-job RUN``): follows the published weight versions and evaluates the due
ones on the held-out prompts, on its own allocation; training never waits for it.

The loop (:meth:`EvalJob.loop`) repeats these named steps:

1. **stop?** USR2 (abandon the version, requeue), SIGTERM or the launcher's stop request (``control/stop.json``,
   Ctrl-C to ``hpcrl run``: abandon it, end ``stopped``; ``--resume`` evaluates it again); the work is over once the
   trainer is done (``control/trainer_done.json`` names the final version) and every due version is handled;
2. **plan** (``schedule.py``): the newest due version that is published, intact and not handled yet; older
   due versions not handled are recorded as ``skipped`` first (the job fell behind, or retention deleted
   them); a due version marked bad is recorded as ``damaged``;
3. **evaluate** it: take it through the weight subscriber (verified, and **pinned**: retention keeps it while
   this job's heartbeat is live), load it into the engine (started the first time, under that pin),
   generate and score every held-out prompt, commit its samples and its row, release the pin;
4. **wait** when nothing is due: poll, log what it waits for, fail after ``timeouts.wait_weights_s`` without
   any new version.

Crash safety: a version is handled once its row is in ``logs/eval.jsonl`` (``logs/eval_log.py``). A restarted job
reads the rows, cuts samples that have no row (``writer.py``) and goes on: a finished version is never
evaluated again, the one it was killed in is evaluated again if it is still on disk (its pin protects it until
the dead job's heartbeat is stale) and recorded as skipped if not. A version the trainer published again after
resuming from an earlier checkpoint (another ``published_s``) is new, and evaluated again.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from typing import Optional

from hpcrl.control.job import Stop, StopWatch, job_main
from hpcrl.control.records import HeartbeatState, HeartbeatThread, JobStats, describe_heartbeats, read_trainer_done
from hpcrl.control.startup import StartupSteps
from hpcrl.eval import schedule
from hpcrl.eval.data import sampling
from hpcrl.eval.evaluate import Evaluator
from hpcrl.eval.parts import EvalInputs, build_inputs, eval_subscriber, start_evaluator
from hpcrl.eval.writer import EvalLogWriter
from hpcrl.logs.eval_log import DAMAGED, EVALUATED, JOB, SKIPPED, EvalRow
from hpcrl.logs.trackers import Trackers, open_trackers
from hpcrl.process.preemption import PreemptionFlag
from hpcrl.reward.scoring import model_rewards
from hpcrl.rundir.paths import EVAL_JOB, RunDir
from hpcrl.weights import WeightSubscriber, WeightVersionBad, WeightVersionGone

log = logging.getLogger("hpcrl.eval")

DONE_POLL_S = 0.5
"""How often the loop reads ``trainer_done.json`` (for the final version; the trainer being done does not stop
this job by itself: its due versions must be handled first)."""


class EvalJob:
    """The evaluation job of a run (module docstring); its steps (:meth:`start`, :meth:`loop`, :meth:`shutdown`)
    run in every job's frame (``control/job.py``)."""

    def __init__(self, run_dir: RunDir, preemption: Optional[PreemptionFlag] = None):
        self.run_dir = run_dir
        self.cfg = run_dir.load_config()
        self.name = "the evaluation job"
        self.requeues = True
        self.watch = StopWatch(run_dir, preemption, {
            Stop.PREEMPTED: "abandoning the version being evaluated and requeueing the evaluation job",
            Stop.STOPPED: "abandoning the version in progress (a --resume evaluates it again)"})
        """Between prompts and polls: USR2 and the launcher's stop request raise :class:`Stopping`."""
        t = self.cfg.timeouts
        self.heartbeat = HeartbeatThread(run_dir, EVAL_JOB, "eval", t.heartbeat_interval_s)
        self.startup = StartupSteps(self.heartbeat, EVAL_JOB, t.job_start_s)
        self.closers = contextlib.ExitStack()
        """Closes the engine, its processes and the subscriber, whatever stage failed."""
        # built once (None until built, so that shutdown works whatever stage failed)
        self.inputs: Optional[EvalInputs] = None
        self.weights: Optional[WeightSubscriber] = None
        self.writer: Optional[EvalLogWriter] = None
        self.evaluator: Optional[Evaluator] = None
        """Started at the first version evaluated, under its pin."""
        self.trackers: Optional[Trackers] = None
        # the loop's own state
        self.handled: dict[int, float] = {}
        """Version -> ``published_s`` of the version handled under that number (0: never seen on disk)."""
        self.final: Optional[int] = None
        """The trainer's final version, once it is done."""
        self._manifest_seen: dict[int, int] = {}  # version -> manifest mtime_ns when last compared
        self._done_checked_s = 0.0
        self._newest = (-1, time.monotonic())  # (newest published version, when it changed)
        self._waiting_logged_s = time.monotonic()

    # ---- building
    def start(self) -> None:
        """The start-up steps: the held-out prompts and reward, the weight subscriber, the evaluation log read back
        (the engine starts at the first version evaluated, under its pin)."""
        cfg, rd, t = self.cfg, self.run_dir, self.cfg.timeouts
        with self.startup.step("loading the tokenizer, held-out prompts and reward", t.job_start_s + t.engine_start_s):
            self.inputs = build_inputs(cfg, rd.model_dir(cfg.model.path),
                                       lambda tokenizer: model_rewards(cfg, rd, EVAL_JOB, tokenizer))
        if self.inputs.scorer.model is not None:
            self.closers.callback(self.inputs.scorer.model.close)
        for line in self.inputs.lines:
            log.info("%s", line)
        self.weights = eval_subscriber(cfg, rd, EVAL_JOB)
        self.closers.callback(self.weights.close)
        with self.startup.step("reading logs/eval.jsonl"):
            self.writer = EvalLogWriter(rd.eval_log, rd.eval_samples, cfg.eval.keep_samples_versions)
        for row in self.writer.rows:
            if row.source == JOB:
                self.handled[row.version] = row.published_s
        if self.handled:
            log.info("resuming: %d versions handled already (newest %d)", len(self.handled), max(self.handled))
        self.trackers = open_trackers(cfg, rd, role="eval")
        self.heartbeat.update(state=HeartbeatState.WAITING_WEIGHTS, step="", step_started_s=0.0)
        self.heartbeat.write()  # out of start-up now: the launcher's Ctrl-C asks it to stop instead of cancelling it

    # ---- steps
    def _policy(self) -> schedule.DuePolicy:
        now = time.monotonic()
        if self.final is None and now - self._done_checked_s >= DONE_POLL_S:
            self._done_checked_s = now
            done = read_trainer_done(self.run_dir)
            if done is not None:
                self.final = done.param_version
                log.info("the trainer is done; its final version is %d", self.final)
        return schedule.DuePolicy(self.cfg.eval.every_versions, self.cfg.eval.before_training, self.final)

    def _plan(self, policy: schedule.DuePolicy) -> schedule.Plan:
        """Step 2: record damaged due versions, notice versions published again, pick the next one."""
        published = self.weights.published_versions()
        if published and published[-1] != self._newest[0]:
            self._newest = (published[-1], time.monotonic())
        usable = []
        for v in published:
            if not policy.is_due(v):
                continue
            if self.weights.is_bad(v):
                if v not in self.handled:
                    self._record(v, DAMAGED, "marked bad by a reader (its files failed verification)")
                continue
            self._forget_if_republished(v)
            usable.append(v)
        return schedule.plan_next(policy, usable, self.handled)

    def _forget_if_republished(self, version: int) -> None:
        """A handled version on disk with another ``published_s`` was published again after a trainer rollback."""
        seen = self.handled.get(version)
        if not seen:
            return
        try:
            stamp = self.run_dir.weight_manifest(version).stat().st_mtime_ns
        except FileNotFoundError:
            return
        if self._manifest_seen.get(version) == stamp:
            return
        self._manifest_seen[version] = stamp
        try:
            manifest = self.weights.read_manifest(version)
        except WeightVersionBad:
            return
        if manifest is not None and manifest.published_s != seen:
            log.warning("weight version %d was published again (the trainer resumed from an earlier checkpoint): "
                        "evaluating the new one", version)
            del self.handled[version]

    def _record(self, version: int, status: str, reason: str, published_s: float = 0.0) -> None:
        """A row for a version that is not evaluated (skipped, damaged)."""
        self.writer.commit(EvalRow(version=version, status=status, source=JOB, published_s=published_s,
                                   started_s=time.time(), reason=reason, sampling=sampling(self.cfg)))
        self.handled[version] = published_s
        (log.error if status == DAMAGED else log.warning)("weight version %d %s, not evaluated: %s", version,
                                                          status, reason)

    def _skip(self, versions: list[int], target: int, on_disk: set[int]) -> None:
        for v in versions:
            self._record(v, SKIPPED, f"behind: evaluating v{target}, the newest due version, instead" if v in on_disk
                         else "not on disk when the job looked (deleted by retention, or published while the job was "
                              "down)")

    def _evaluate(self, version: int) -> None:
        """Step 3: take (pin), load, evaluate, commit, release."""
        self.heartbeat.update(state=HeartbeatState.EVALUATING, stats=self._stats(evaluating=version))
        started = time.time()
        try:
            wv = self.weights.take(version)
        except WeightVersionGone as e:
            log.warning("%s; planning again", e)
            return
        except WeightVersionBad as e:
            self._record(version, DAMAGED, str(e))
            return
        with wv:  # pinned until the row is durable
            if self.evaluator is None:
                self.evaluator = start_evaluator(self.cfg, self.inputs, self.run_dir.model_dir(self.cfg.model.path),
                                                 self.closers, JOB, self.startup)
            load_s = wv.transfer_s + self.evaluator.load(wv)
            self.heartbeat.update(state=HeartbeatState.EVALUATING, step="", step_started_s=0.0)
            self.heartbeat.write()  # the engine's start-up step is over (its 'starting' is on disk until now)
            result = self.evaluator.evaluate(version, self.watch.raise_if_asked, lambda done, total: self.heartbeat.update(
                stats=self._stats(evaluating=version, done=done)))
            row = self.writer.commit(EvalRow(
                version=version, status=EVALUATED, source=JOB, trainer_step=wv.manifest.trainer_step,
                published_s=wv.manifest.published_s, started_s=started, load_s=load_s, eval_s=result.eval_s,
                prompts=len(self.inputs.rows), n=self.cfg.eval.n, score=result.score, score_name=result.score_name,
                metrics=result.metrics, sampling=sampling(self.cfg)), result.samples)
        self.handled[version] = row.published_s
        if self.trackers is not None:
            self.trackers.log({"step": row.trainer_step, **row.metrics})
        log.info("v%d (step %d): %s %.3f; %d prompts x %d in %.1fs (load %.2fs)", version, row.trainer_step,
                 row.score_name, row.score if row.score is not None else float("nan"), row.prompts, row.n,
                 row.eval_s, row.load_s)
        self.heartbeat.update(param_version=version, state=HeartbeatState.WAITING_WEIGHTS, stats=self._stats())

    def _stats(self, evaluating: Optional[int] = None, done: int = 0) -> JobStats:
        """The heartbeat's counters: the last evaluated version and score, the one in progress."""
        last = next((r for r in reversed(self.writer.rows) if r.source == JOB and r.status == EVALUATED), None)
        return JobStats(last_version=last.version if last else None, score=last.score if last else None,
                        score_name=last.score_name if last else None, evaluating=evaluating, prompts_done=done,
                        prompts=len(self.inputs.rows), skipped=sum(r.status == SKIPPED for r in self.writer.rows))

    def _wait(self) -> None:
        """Step 4: nothing due now; fail once no new version has appeared for ``timeouts.wait_weights_s``."""
        t = self.cfg.timeouts
        waited = time.monotonic() - self._newest[1]
        if waited > t.wait_weights_s:
            raise TimeoutError(f"eval: no new weight version in {self.run_dir.weights} for {waited:.0f}s (newest "
                               f"{self._newest[0]}); {describe_heartbeats(self.run_dir, 'trainer')}")
        if time.monotonic() - self._waiting_logged_s > t.wait_log_interval_s:
            self._waiting_logged_s = time.monotonic()
            log.info("waiting for the next due version (every %d; newest published %d, %.0fs ago); %s",
                     self.cfg.eval.every_versions, self._newest[0], waited, describe_heartbeats(self.run_dir, "trainer"))
        time.sleep(max(t.poll_interval_s, 0.1))

    # ---- the loop
    def loop(self) -> Stop:
        """Steps 1-4 until the work is over; returns DONE (a stop or preemption is raised from between two prompts
        as :class:`Stopping`, SIGTERM as SystemExit)."""
        while True:
            self.watch.raise_if_asked()
            policy = self._policy()
            plan = self._plan(policy)
            if plan.target is None:
                if policy.final is not None:  # nothing left on disk to evaluate: what is left was lost
                    self._skip([v for v in policy.due_up_to(policy.final) if v not in self.handled], policy.final,
                               set())
                if schedule.all_handled(policy, self.handled):
                    log.info("every due version up to the final one (%d) is handled", policy.final)
                    return Stop.DONE
                self._wait()
                continue
            self._skip(plan.skipped, plan.target, set(self.weights.published_versions()))
            self._evaluate(plan.target)

    def shutdown(self, final_state: HeartbeatState) -> None:
        """Stop the prompts in flight, close the logs, the engine and its processes."""
        try:
            self.closers.close()
            if self.writer is not None:
                self.writer.close()
            if self.trackers is not None:
                self.trackers.close()
        except Exception as e:  # noqa: BLE001 - shutting down: say so and go on
            log.warning("closing the evaluation job failed: %s", e)
        finally:
            log.info("evaluation job %s: %d versions evaluated", final_state,
                     sum(r.status == EVALUATED and r.source == JOB for r in self.writer.rows) if self.writer else 0)


def eval_main(run_dir: str) -> None:
    """The evaluation job's entry point (``hpcrl eval-job RUN``, the launcher, ``sbatch/eval.sbatch``): every job's
    life (``control/job.py``) around :class:`EvalJob`."""
    job_main(run_dir, EVAL_JOB, ("eval-job",), lambda rd, preemption: EvalJob(rd, preemption))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="hpcrl evaluation job (normally started by `hpcrl run` or sbatch/)")
    p.add_argument("run_dir")
    eval_main(p.parse_args(argv).run_dir)


if __name__ == "__main__":
    main()
