"""Rollout job: generate groups with the newest weights and commit them as shards.

The loop (:meth:`RolloutJob.loop`) repeats these named steps:

1. **stop?** USR2 (seal and requeue), ``control/trainer_done.json`` (seal, exit 0), the launcher's
   ``control/stop.json`` (Ctrl-C: seal, save the groups in flight, exit 0 as ``stopped``) or a drain record for this
   writer (``control/fleet.py``: finish, seal, release the budget and the claims, exit 0 as ``drained``);
2. **new weights?** a newer complete version exists (or an *older* newest one: the trainer rolled back to a
   checkpoint): stop admitting, let the groups in flight finish, seal them, load the version; with
   ``partial_rollout``, abort them instead and let them continue under the new version (``rollout/gate.py``);
3. **admit**: while the admission rule allows (the shared budget, this job's share of it by load and its bound
   ``rollout.max_concurrent_groups``, of groups generating: ``reward_model.scoring_groups`` more may wait for rewards),
   reserve a start and claim its prompt index (``control/admission.py``, ``control/claims.py``): its own, else new;
4. **collect** finished groups (n responses and all their rewards) into the shard buffer;
5. **seal** the buffer when it is full, old, or nothing is in flight (the commit). A group the commit refuses
   because it could be trained beyond the lag bound (the job missed a version) is taken out of the shard and,
   once the newest version is loaded, carried into it (partial rollout: its trajectories' last sampled tokens
   are generated again there) or generated again from scratch, each counted (``fully_async/lag_bound/*``);
6. **wait** when nothing was admitted, collected or is in flight: the version's budget is spent, so only a
   newer version (or trainer_done) lets the job go on.

Steps 1, 2, the re-admission of a job whose budget is spent, and the skipped prompts look at the run
directory only when ``control/changes.jsonl`` grew (``control/changes.py``: one stat, backing off from
``timeouts.poll_interval_s`` to ``poll_max_s`` while nothing changes, and every 10 s anyway): every writer
of what they look for appends to it after the change. Step 2 also looks when the commit refused a group (a newer
version exists then); a job refused by its share tries again when one of its own groups finishes.

What it waits for: weight version 0 at start, and a newer version whenever the budget is spent; each wait logs
what it waits for and the trainer's heartbeat, and fails after ``timeouts.wait_weights_s``. If the trainer dies,
this job keeps its committed shards and waits so (the restarted trainer re-publishes and the job reloads). If
*this* job dies, nothing committed is lost: its successor (same writer name) recovers from the manifest, releases
the budget its predecessor held for groups in flight, and regenerates exactly the prompts that were never committed.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Optional

from hpcrl.logs import metric_names as M
from hpcrl.config.registries import estimator_spec
from hpcrl.control.changes import ChangeWatch
from hpcrl.control.job import Stop, StopWatch, job_main
from hpcrl.control.records import HeartbeatState, HeartbeatThread, JobStats, describe_heartbeats, ended_state
from hpcrl.control.startup import StartupSteps
from hpcrl.rundir.fsio import wait_for
from hpcrl.process import faults, termination
from hpcrl.process.preemption import PreemptionFlag
from hpcrl.rollout.agent_loop import GroupContext, group_seed, run_group
from hpcrl.rollout.engine import FINISH_LENGTH
from hpcrl.rollout.gate import EngineGate
from hpcrl.rollout.late import LateGroups
from hpcrl.rollout.loops import loop_name
from hpcrl.rollout.parts import RolloutParts, build_parts, scoring_groups
from hpcrl.rollout.trajectory import TrajectoryState
from hpcrl.rollout.version_stats import GroupInfo, VersionStats, sample_columns
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.samples.writer import CommitRefused
from hpcrl.weights import WeightVersion
from hpcrl.weights.shared_memory import SHM_DIR, sweep_stale

log = logging.getLogger("hpcrl.rollout")


class EngineLoadFailed(Exception):
    """The engine could not adopt a verified weight version (the files are fine: not marked bad)."""


class RolloutJob:
    """One rollout job: writer ``w<rank>`` of the run (any number of them, joining at any time), generating and
    committing groups.

    See the module docstring for the loop; its steps (:meth:`start`, :meth:`loop`, :meth:`shutdown`) run in
    every job's frame (``control/job.py``).
    """

    def __init__(self, run_dir: RunDir, writer_rank: int, preemption: Optional[PreemptionFlag] = None):
        self.run_dir = run_dir
        self.cfg = run_dir.load_config()
        if writer_rank < 0:
            raise ValueError(f"writer rank {writer_rank} must be >= 0 (it names the writer: w000, w001, ...)")
        self.writer = RunDir.writer_name(writer_rank)
        """The job's writer: its identity across its own requeues (its shards, claims, groups in flight)."""
        self.name = f"rollout {self.writer}"
        self.requeues = True
        self.changes = ChangeWatch(run_dir, self.cfg.timeouts.poll_interval_s, self.cfg.timeouts.poll_max_s)
        """Whether anything the loop waits for may have changed (``control/changes.py``): steps 1-3 look then."""
        self.watch = StopWatch(run_dir, preemption, {
            Stop.PREEMPTED: "sealing complete groups and requeueing this rollout job",
            Stop.DONE: "sealing complete groups and stopping",
            Stop.STOPPED: "sealing complete groups, saving those in flight",
            Stop.DRAINED: lambda: (f"finishing {len(self.in_flight)} groups in flight, sealing, releasing the budget "
                                   "and prompt claims")}, trainer_done=True, writer=self.writer, changes=self.changes)
        """Step 1: USR2, trainer_done, the launcher's stop request, a drain request for this writer."""
        self.heartbeat = HeartbeatThread(run_dir, RunDir.rollout_job(self.writer), "rollout",
                                         self.cfg.timeouts.heartbeat_interval_s)
        self.startup = StartupSteps(self.heartbeat, RunDir.rollout_job(self.writer), self.cfg.timeouts.job_start_s)
        """Named, bounded start-up steps (shown in the heartbeat)."""
        self.parts: Optional[RolloutParts] = None
        """Everything built once (``parts.py``); None until built, so that shutdown works whatever stage failed."""
        self.gate = EngineGate()
        """Closed while weights are switched, stopped at shutdown (``gate.py``)."""
        # the loop's own state
        self.version = -1
        """The weight version the engine holds (-1: none yet)."""
        self.consumed_at_version = 0
        """Groups the trainer had consumed when it published that version (the admission budget's base)."""
        self.in_flight: dict[Future, int] = {}
        """Groups generating (or parked at the gate, or waiting for their rewards) -> their prompt index."""
        self.stats: Optional[VersionStats] = None
        """Counters of the current version, written as a row when the next one is loaded."""
        self.bound = self.cfg.knobs.group_bound
        """Groups this job may have generating at most (``rollout.max_concurrent_groups``, ``auto``)."""
        self.max_in_flight = self.bound + scoring_groups(self.cfg)  # the rest waiting for their rewards
        self.late = LateGroups(self.cfg.async_training.partial_rollout)
        """Groups the commit refused (lag bound), to start again once the newest version is loaded."""
        self._budget_spent = False  # the last try to admit found the budget spent: try again after a change
        self._share_full: Optional[int] = None  # in flight at the last refusal by share: try again below that
        self._blocked_since: Optional[float] = None
        self._failed_load: tuple[int, float] = (-1, 0.0)  # (version, monotonic time) of the last failed engine load

    # ---- the group task (runs in a pool thread)
    def _generate_group(self, prompt_index: int) -> tuple[Group, GroupInfo]:
        """The group of ``prompt_index`` with its rewards, by the row's agent loop (``agent_name``, else
        ``agent.default``), continued from a saved state if the previous job left one. With an estimator whose
        spec needs a greedy baseline (remax) one more trajectory of the group is decoded greedily (as verl's remax
        branch adds one greedy request per prompt); its reward is the group's ``reward_baseline``, it is not trained.
        GroupAborted if the job stops meanwhile (its state stays live for :meth:`shutdown` to save)."""
        p, ro = self.parts, self.cfg.rollout
        row = p.stream[prompt_index]
        created = time.time()
        prompt_ids = list(row["prompt_ids"])  # chat template and max_prompt_length applied in the build
        loop = p.loops[loop_name(row, self.cfg.agent)]
        baseline = [TrajectoryState(greedy=True)] if estimator_spec(self.cfg.algorithm.adv_estimator).greedy_baseline \
            else []
        trajs, resumed = p.states.start(prompt_index, loop.name, [TrajectoryState() for _ in range(ro.n)] + baseline)
        ctx = GroupContext(p.engine, self.gate, prompt_ids, group_seed(self.cfg.data.seed, prompt_index),
                           ro.response_length)
        run_group(loop, ctx, trajs, p.runner, self.cfg.timeouts.generate_s,
                  f"generating the group of prompt {prompt_index}")
        ids = [f"{self.writer}/{prompt_index}/{'greedy' if t.greedy else j}" for j, t in enumerate(trajs)]
        texts = [p.tokenizer.decode(t.tokens, skip_special_tokens=True) for t in trajs]
        # generated: the engine may take another group while this one waits for its rewards (scorer.waiting)
        scores = p.scorer.score_group(ids, row, [(t.tokens, text) for t, text in zip(trajs, texts)],
                                      [loop.reward_info(t) for t in trajs], stop=lambda: self.gate.stopping)
        out, sample, reward_baseline = [], {}, None
        for t, sample_id, text, score in zip(trajs, ids, texts, scores):
            shaped = p.shaping.shape(*score, len(t.tokens))
            reward = shaped.reward
            if t.greedy:
                reward_baseline = reward
                continue
            p.scorer.note(shaped.logged)
            truncated = t.finish_reason == FINISH_LENGTH if self.cfg.actor.overlong_filter else None
            out.append(Trajectory(prompt_ids=prompt_ids, response_ids=t.tokens, response_mask=t.mask,
                                  logprobs=t.logprobs, token_versions=t.versions, reward=reward,
                                  truncated=truncated, filter_metric=shaped.metric))
            sample = sample or sample_columns(sample_id, row["prompt"], text, reward)
        group = Group(writer=self.writer, prompt_index=prompt_index, trajectories=out, created_s=created,
                      finished_s=time.time(), reward_baseline=reward_baseline)
        sampled = [t for t in trajs if not t.greedy]
        return group, GroupInfo.of(sampled, resumed, f"{self.writer}/{prompt_index}", sample)

    # ---- steps of the loop
    def _apply_to_engine(self, wv: WeightVersion) -> tuple[str, float]:
        """Hand a verified version to the engine: how it reached the engine and the seconds it took;
        EngineLoadFailed if the engine cannot take it."""
        t0 = time.monotonic()
        try:
            faults.point("engine_load")
            how = self.parts.runner.call(lambda: self.parts.engine.load_weights(wv), self.cfg.timeouts.generate_s,
                                         f"loading weight version {wv.version} ({wv.folder}) into the "
                                         f"{self.cfg.rollout.engine} engine")
        except Exception as e:  # noqa: BLE001 - any engine error: the caller decides whether the job can go on
            raise EngineLoadFailed(f"{type(e).__name__}: {e}") from e
        return how, time.monotonic() - t0

    def _load_newest(self) -> None:
        """Load the newest intact version; a damaged one is marked bad and skipped (the trainer publishes again); if
        none is intact, wait for one. The caller has drained the groups in flight.

        If the engine fails to take a version, the job stays on the one it has (re-applied, since a half-done load
        may have changed part of the weights) and says so; it tries again after ``timeouts.retry_failed_load_s``.
        Without a version to fall back on (start-up), or if re-applying fails too, the job fails (its restart
        starts a fresh engine)."""
        t0 = time.time()
        faults.point("weight_load")
        try:
            wv, how, apply_s = self._load_newest_or_wait()
        except EngineLoadFailed as e:
            if self.version < 0:
                raise
            failed = self.parts.weights.newest_usable()
            log.error("the %s engine could not load weight version %s (%s); staying on version %d and trying "
                      "again in %.0fs", self.cfg.rollout.engine, failed, e, self.version,
                      self.cfg.timeouts.retry_failed_load_s)
            self._failed_load = (failed if failed is not None else -1, time.monotonic())
            with self.parts.weights.take(self.version) as wv:
                self._apply_to_engine(wv)
            self.gate.open(self.version)
            return
        self._adopt(wv, how, apply_s, time.time() - t0)

    def _load_newest_or_wait(self) -> tuple[WeightVersion, str, float]:
        """Take the newest usable version (waiting while every one is marked bad) and hand it to the engine."""
        weights = self.parts.weights
        while (wv := weights.take_newest()) is None:
            t = self.cfg.timeouts
            wait_for(f"an intact weight version in {self.run_dir.weights} (every one is marked bad)",
                     lambda: self.changes.changed("weights") and weights.newest_usable() is not None, t.wait_weights_s,
                     t.poll_interval_s, log,
                     describe=lambda: describe_heartbeats(self.run_dir, "trainer"), stop=termination.check)
        with wv:
            how, apply_s = self._apply_to_engine(wv)
        return wv, how, apply_s

    def _adopt(self, wv: WeightVersion, how: str, apply_s: float, load_s: float) -> None:
        """The engine holds version ``wv``: report it (heartbeat, stats) only now."""
        if self.stats is not None:
            self._write_version_stats()
        self.version, self.consumed_at_version = wv.version, wv.manifest.consumed_groups
        self.parts.admission.holding = (self.version, self.consumed_at_version)  # the commit's lag check
        self._budget_spent, self._share_full = False, None  # a new version's budget
        self.stats = VersionStats(self.version, load_s=load_s, sync=wv.metrics(apply_s),
                                  prompts={M.PROMPTS_FILTERED: self.parts.prompt_counts.filtered,
                                           M.PROMPTS_TRUNCATED: self.parts.prompt_counts.truncated})
        self.gate.open(self.version)
        self.heartbeat.update(param_version=self.version, state=HeartbeatState.GENERATING)
        log.info("loaded weight version %d in %.2fs by %s into the engine's %s (trainer step %d, consumed %d groups)",
                 self.version, load_s, wv.path, how, wv.manifest.trainer_step, wv.manifest.consumed_groups)

    def _switch_weights_if_newer(self, changed: bool) -> None:
        """Step 2: load a newer version; also an *older* newest one: the trainer was restarted from a checkpoint and
        withdrew the versions published after it. Looked for only if the run directory ``changed``."""
        if not changed:
            return
        v = self.parts.weights.newest_usable()
        if v is None or v == self.version:
            return
        failed_v, failed_at = self._failed_load
        if v == failed_v and time.monotonic() - failed_at < self.cfg.timeouts.retry_failed_load_s:
            return
        if v < self.version:
            log.warning("newest weight version is %d, below ours (%d): the trainer rolled back; reloading",
                        v, self.version)
        if self.cfg.async_training.partial_rollout:
            self._interrupt()
        else:
            self._drain()
        self._seal()
        self._load_newest()

    def _interrupt(self) -> None:
        """Partial rollout: stop the generations in flight where they are (their groups stay in flight and continue
        under the new version once the gate opens)."""
        t0 = time.monotonic()
        self.gate.close()
        if any(not f.done() for f in self.in_flight):
            self.parts.runner.call(self.parts.engine.abort_all, self.cfg.timeouts.generate_s,
                                   "aborting generation for new weights")
            self._wait_parked()
        self._collect(timeout_s=0.0)  # groups that finished are committed before the load: the lag bound needs it
        self.parts.states.save()  # all parked: a successor continues them from here
        carried = len(self.in_flight)
        self.stats.partial_groups += carried
        self.stats.pause_s += time.monotonic() - t0
        log.debug("paused %d groups in flight in %.3fs for a weight switch", carried, time.monotonic() - t0)

    def _generating(self) -> int:  # what the bound and the share count: a group waiting for rewards holds no slot
        return len(self.in_flight) - self.parts.scorer.waiting

    def _admit(self, changed: bool) -> bool:
        """Step 3: start every group the concurrency limit, the shared budget and this job's share allow, in one turn
        at the admission lock (``Admission.start``); True if any. Prompts of
        shards the trainer skipped as damaged are generated again first. Once the budget is spent, it is tried again
        only after the run directory ``changed`` (a new version, a skipped shard, a writer's budget handed back: each
        bumps ``control/changes.jsonl``)."""
        p = self.parts
        if changed:
            p.positions.requeue(p.shards.take_skipped_prompts())
        elif self._budget_spent or (self._share_full is not None and self._generating() >= self._share_full):
            return False
        self._budget_spent, self._share_full = False, None
        room = min(self.bound - self._generating(), self.max_in_flight - len(self.in_flight))
        if room <= 0:
            return False
        started = p.admission.start(self.consumed_at_version, room, own=p.positions.peek(room),
                                    in_flight=self._generating(), look_for_skips=changed)
        for index in started:  # every start the rule allows, in one turn at the lock (as hpcrl plan serves a job)
            p.positions.taken(index)
            self._submit(index)
        if len(started) < room:
            if p.admission.refused == "budget":
                self._budget_spent = True
            else:  # at its share: a group of its own finishing (or a change) lets it try again
                self._share_full = self._generating()
        return bool(started)

    def _collect(self, timeout_s: float) -> bool:
        """Step 4: move finished groups into the shard buffer (waiting up to ``timeout_s``); True if any.
        Time spent here with nothing in flight counts as idle."""
        if not self.in_flight:
            return False
        done, _ = wait(list(self.in_flight), timeout=timeout_s, return_when=FIRST_COMPLETED)
        for fut in done:
            self.in_flight.pop(fut)
            group, info = fut.result()  # an exception in generation stops the job, loudly
            self.parts.states.finish(group.prompt_index)
            self.parts.shards.add(group)
            self.stats.count(group, info.truncated)
            self.stats.count_agent(info.turns, info.tool_calls, info.tool_errors, info.tool_latency_s)
            self.stats.note_group(info.tool_error, info.sample)
            self.stats.resumed_groups += info.resumed
        return bool(done)

    def _wait_parked(self) -> None:
        """Wait until every group in flight is either done or parked at the closed gate: then no generate call is
        running, and no group that has all its tokens from this version (it may still be scoring them) can commit
        after the next version is loaded."""
        deadline = time.monotonic() + self.cfg.timeouts.generate_s
        while sum(f.done() for f in self.in_flight) + self.gate.parked < len(self.in_flight):
            if time.monotonic() > deadline:
                raise TimeoutError(f"groups in flight neither finished nor paused in {self.cfg.timeouts.generate_s:.0f}s "
                                   "after the engine was aborted for new weights")
            time.sleep(0.001)

    def _drain(self) -> None:
        """Collect until no group is in flight (before a weight switch)."""
        while self.in_flight:
            self._collect(timeout_s=1.0)

    def _seal_if_due(self) -> None:
        """Step 5: commit the buffer when it is full or old, or when nothing is in flight."""
        if self.parts.shards.seal_due() or (not self.in_flight and self.parts.shards.buffered):
            self._seal()

    def _seal(self) -> None:
        """Commit the buffer; groups the commit refuses for the lag bound wait in :attr:`late` (``late.py``)."""
        while True:
            try:
                line = self.parts.shards.seal()
            except CommitRefused as e:
                self.late.take(e, self.parts.shards, self.parts.states, self.stats, self.version)
                continue
            break
        if line is not None:
            self.parts.states.release(line.prompt_indices)
            self.heartbeat.update(stats=JobStats(groups_committed=self.parts.shards.committed_groups))
            log.debug("committed %s (%d groups)", line.shard, line.n_groups)

    def _start_late(self) -> None:
        """Start the refused groups again (step 2 has loaded the newest version)."""
        self.late.start(self.version, self.parts.admission, self._submit)

    def _submit(self, index: int) -> None:
        """The group of prompt ``index`` generates in a pool thread."""
        self.in_flight[self.parts.pool.submit(self._generate_group, index)] = index

    def _wait_if_blocked(self, progressed: bool) -> None:
        """Step 6: with nothing in flight and no progress, the budget of this version is spent: sleep one poll (idle
        time) and fail once the wait exceeds timeouts.wait_weights_s."""
        if progressed or self.in_flight:
            if self._blocked_since is not None:
                self.heartbeat.update(state=HeartbeatState.GENERATING)
            self._blocked_since = None
            return
        now = time.monotonic()
        if self._blocked_since is None:
            self._blocked_since = now
            self.heartbeat.update(state=HeartbeatState.WAITING_WEIGHTS)
        waited_s = now - self._blocked_since
        if waited_s > self.cfg.timeouts.wait_weights_s:
            raise TimeoutError(
                f"rollout {self.writer}: budget used up for weight version {self.version} and no newer version "
                f"appeared in {self.run_dir.weights} for {waited_s:.0f}s ({describe_heartbeats(self.run_dir, 'trainer')})")
        time.sleep(self.cfg.timeouts.poll_interval_s)
        self.stats.idle_s += self.cfg.timeouts.poll_interval_s

    def _write_version_stats(self) -> None:
        self.parts.metrics.write({**self.stats.row(self.writer), **self.parts.scorer.pop_metrics()})

    # ---- the loop
    def start(self) -> None:
        """Build, wait for version 0 and load it (start-up steps)."""
        t = self.cfg.timeouts
        self.parts = build_parts(self.cfg, self.run_dir, self.writer, self.startup)
        weights = self.parts.weights
        with self.startup.step("waiting for weight version 0", t.wait_weights_s + 60):
            wait_for(f"weight version 0 in {self.run_dir.weights}",
                     lambda: self.changes.changed("weights") and weights.newest_usable() is not None,
                     t.wait_weights_s, t.poll_interval_s, log,
                     describe=lambda: describe_heartbeats(self.run_dir, "trainer"), stop=termination.check)
        with self.startup.step("loading the first weight version", t.wait_weights_s + t.generate_s):
            self._load_newest()
        self.heartbeat.update(step="", step_started_s=0.0)
        self.heartbeat.write()  # out of start-up now: the launcher's Ctrl-C waits for it to seal from here on

    def loop(self) -> Stop:
        """Steps 1-6 of the module docstring until stopped; returns DONE, STOPPED, PREEMPTED or DRAINED."""
        poll_s = self.cfg.timeouts.poll_interval_s
        while True:
            stop = self.watch.check()
            if stop == Stop.DRAINED:
                self._finish_in_flight()  # every group admitted is committed: nothing is left for a successor
            if stop is not None:
                return stop
            changed = self.changes.changed("loop")
            self._switch_weights_if_newer(changed or bool(self.late))
            self._start_late()
            admitted = self._admit(changed)
            t0 = time.monotonic()
            collected = self._collect(timeout_s=poll_s)
            if not self.in_flight:
                self.stats.idle_s += time.monotonic() - t0
            self._seal_if_due()
            self._wait_if_blocked(progressed=admitted or collected)

    def _finish_in_flight(self) -> None:
        """Drained: nothing more is admitted; the groups in flight finish as in the loop, weight switches included
        (a group continues under the newest version, as the lag bound needs), and are sealed."""
        while True:
            while self.in_flight or self.late:
                termination.check()
                self._switch_weights_if_newer(self.changes.changed("loop") or bool(self.late))
                self._start_late()
                self._collect(timeout_s=self.cfg.timeouts.poll_interval_s)
                self._seal_if_due()
            self._seal()
            if not self.late:  # else refused at the last seal: one more round
                return

    def _abort_generations(self) -> None:
        """Stop the generations in flight (their groups are dropped: the successor regenerates them)."""
        self.gate.stop()
        if any(not f.done() for f in self.in_flight):
            try:
                self.parts.runner.call(self.parts.engine.abort_all, 60.0, "aborting the generations in flight")
            except Exception as e:  # noqa: BLE001 - shutting down: say so and go on
                log.warning("could not abort the engine's generations: %s", e)

    def _keep_what_finished(self) -> None:
        """Stop the groups in flight; keep the complete ones and save the states of the rest for this writer's next
        job."""
        p = self.parts
        for fut in self.in_flight:
            fut.cancel()
        self._abort_generations()
        p.pool.shutdown(wait=True, cancel_futures=True)
        for fut in list(self.in_flight):  # finished while shutting down: complete groups are worth keeping
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                p.shards.add(fut.result()[0])
                p.states.finish(self.in_flight[fut])
        p.states.save()

    def shutdown(self, final_state: HeartbeatState) -> None:
        """Seal complete groups, save those in flight, write the last version row, release the engine. Works
        whatever stage the job failed in (nothing built yet, no version loaded, ...)."""
        p = self.parts
        try:
            if p is not None:
                self._keep_what_finished()
                p.shards.close()
                p.admission.leave(ended_state(final_state))  # drained: hands back its budget and claims
                if self.stats is not None:
                    self._write_version_stats()
                p.metrics.close()
        finally:
            if p is not None:
                p.close()
            log.info("rollout %s %s: %d groups committed in total", self.writer, ended_state(final_state),
                     p.shards.committed_groups if p is not None else 0)


def rollout_main(run_dir: str, writer_rank: int) -> None:
    """A rollout job's entry point (``hpcrl rollout RUN --writer-rank N``): every job's life (``control/job.py``)
    around :class:`RolloutJob`, after the ``/dev/shm`` weight buffers of dead processes are swept."""
    writer = RunDir.writer_name(writer_rank)

    def build(rd: RunDir, preemption: PreemptionFlag) -> RolloutJob:
        if not sweep_stale():  # their /dev/shm weight buffers (any dead process's), now that they are gone
            log.info("start-up sweep: no weight buffers of dead processes in %s", SHM_DIR)
        return RolloutJob(rd, writer_rank, preemption)

    job_main(run_dir, RunDir.rollout_job(writer), ("rollout", "--writer-rank", str(writer_rank)), build)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="hpcrl rollout job (normally started by `hpcrl run` or sbatch/)")
    p.add_argument("run_dir")
    p.add_argument("--writer-rank", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)))
    a = p.parse_args(argv)
    rollout_main(a.run_dir, a.writer_rank)


if __name__ == "__main__":
    main()
