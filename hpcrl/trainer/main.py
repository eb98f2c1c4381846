"""Trainer job: consume committed groups, update the policy with DeepSpeed, publish weights.

One local update (:meth:`TrainerJob.loop`):

1. **take** ``R = ppo_mini_batch_size * require_batches`` groups in commit order (``intake.py``: groups over
   ``max_staleness``, and any whose newest token lags by more than the lag bound, which the rollout jobs' commit
   check keeps out, are dropped, counted and replaced; with ``algorithm.filter_groups`` so are groups whose metric
   has no spread, their admission places given back: ``dynamic_sampling.py``);
2. **update** (:class:`hpcrl.trainer.update.PolicyUpdate`): proximal / reference
   log-probs and values under the weights at the start of the update,
   off-policy corrections, advantages (``algorithm.adv_estimator``), then
   ``ppo_epochs`` passes of ``require_batches`` optimizer steps (DeepSpeed, any
   ZeRO stage, gloo on CPU);
3. **log** one staleness row per trajectory and one metrics row;
4. every ``K = trigger_parameter_sync_step`` updates **publish** version ``v+1``
   (filesystem), then apply weight retention;
5. every ``trainer.checkpoint_every_updates`` updates (always right after a
   publish) **checkpoint** model, optimizer, cursor and log offsets together.

If a rollout job finds the newest weight version damaged (it marks it bad and falls back
to an older one), this job publishes its current weights as a new version at once.
On USR2 (preemption) or the launcher's stop request (Ctrl-C, ``control/stop.json``) it finishes the
update it is in, checkpoints it and ends (USR2: requeued); a resume redoes nothing.
If a rollout job dies, this job waits for committed groups, logging which writers
it waits for and their heartbeat ages, and fails after ``timeouts.wait_samples_s``.
If *this* job dies, a restart resumes from the newest checkpoint: it rolls its
logs back to the checkpoint, removes weight versions published after it (they
are re-published from the restored model) and re-reads from the saved cursor,
so every committed group is trained on exactly once.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
import time
from typing import Optional

import torch

from hpcrl.logs import metric_names as M
from hpcrl.control.changes import ChangeWatch, bump
from hpcrl.control.job import Stop, StopWatch, job_main
from hpcrl.control.records import HeartbeatState, HeartbeatThread, JobStats, TrainerDone
from hpcrl.control.startup import StartupSteps
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.logs.run_logs import log_size
from hpcrl.process import faults, termination
from hpcrl.process.preemption import PreemptionFlag
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import delete_consumed
from hpcrl.samples.schema import Group
from hpcrl.trainer import checkpoint, memory
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.distributed import init_distributed, rank_environment, rank_from_environment
from hpcrl.trainer.dynamic_sampling import (DROPPED as FILTERED, LAG_BOUND, MAX_STALENESS, Dropped, DynamicSampling,
                                            count_dropped)
from hpcrl.trainer.gather import zero3_state_dict
from hpcrl.trainer.intake import GroupIntake
from hpcrl.trainer.lora import adapter_state_dict
from hpcrl.trainer.models import POLICY_PREFIX, policy_state_dict
from hpcrl.trainer.ops import prepare_ops
from hpcrl.trainer.parts import LeadParts, TrainerParts, build_parts
from hpcrl.trainer.share import ABORT, BATCH, PREEMPT, REPUBLISH, STOP, share_groups, share_json

log = logging.getLogger("hpcrl.trainer")

class _NoHeartbeat:
    """Ranks other than 0 do not write heartbeats."""

    def start(self) -> "_NoHeartbeat":
        return self

    def update(self, **fields) -> None:
        pass

    def write(self) -> None:
        pass

    def stop(self, final_state: str) -> None:
        pass



@contextlib.contextmanager
def stack_dump_after(seconds: float):
    """Every thread's stack to stderr if the block still runs after ``seconds`` (``timeouts.stuck_update_s``; 0:
    never): faulthandler writes it from its own thread, so a rank stuck inside a C++ collective is shown too."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds, repeat=False, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()

class TrainerJob:
    """One rank of the trainer job. Rank 0 reads samples, writes logs, heartbeats and weight
    versions; every rank trains its share of each mini-batch. Its steps (:meth:`start`, :meth:`loop`,
    :meth:`shutdown`) run in every job's frame (``control/job.py``); see the module docstring for what happens
    when either job dies."""

    def __init__(self, run_dir: RunDir, preemption: PreemptionFlag, rank: int, world: int):
        self.run_dir = run_dir
        self.cfg = run_dir.load_config()
        self.rank, self.world = rank, world
        self.name = f"trainer rank {rank}"
        self.requeues = rank == 0
        """Rank 0 asks Slurm to requeue the job when it is preempted."""
        self.changes = ChangeWatch(run_dir, self.cfg.timeouts.poll_interval_s, self.cfg.timeouts.poll_max_s)
        """Rank 0's: whether the stop request or a bad marker may have appeared (``control/changes.py``)."""
        self.watch = StopWatch(run_dir, preemption, {
            Stop.PREEMPTED: "checkpointing the last completed update, then requeueing the trainer",
            Stop.STOPPED: "checkpointing the last completed update"}, changes=self.changes)
        """Rank 0's: USR2 or the launcher's stop request end the run at the next update boundary."""
        self.heartbeat = (HeartbeatThread(run_dir, RunDir.trainer_job(), "trainer", self.cfg.timeouts.heartbeat_interval_s)
                          if self.rank == 0 else _NoHeartbeat())
        self.startup = StartupSteps(self.heartbeat, RunDir.trainer_job(rank), self.cfg.timeouts.job_start_s)
        """Named, bounded start-up steps (shown in the heartbeat)."""
        self.parts: Optional[TrainerParts] = None
        """Everything built once (``parts.py``); None until built."""
        # the loop's own state
        self.state = checkpoint.TrainerState()
        """Step, version, consumed groups, cursor, counters: what a checkpoint saves."""
        self._boundary: dict = self.state.to_json()
        """The state right after the last completed update: what a checkpoint taken now holds."""
        self._last_checkpoint_step = 0
        self._sync_stats: dict = {}  # metrics of the last publish (gather, files, broadcast)
        self.sampling = DynamicSampling(self.cfg, run_dir)
        """``algorithm.filter_groups``: which taken groups may enter an update, and the bound on how many it takes."""
        self.intake = GroupIntake(self.cfg, run_dir, self.watch, self.heartbeat, self.sampling)
        """Rank 0's: each update's groups from the shards (``intake.py``)."""
        self._gathers_logged = False
        self._shards_removed: dict[str, int] = {}  # writer -> manifest lines whose consumed shards are removed

    @property
    def lead(self) -> LeadParts:
        """Rank 0's parts (the run directory's readers and writers)."""
        assert self.parts is not None and self.parts.lead is not None, "rank 0 only"
        return self.parts.lead

    def start(self) -> None:
        """The start-up steps: DeepSpeed's ops, the ranks' own process group, the parts (model, checkpoint, run
        directory), then the resume from the checkpoint or a fresh start."""
        t, cfg = self.cfg.timeouts, self.cfg
        with self.startup.step("loading DeepSpeed's ops"):
            prepare_ops(t.job_start_s)
        with self.startup.step(f"joining the other trainer ranks ({self.world} in all)"):
            init_distributed(t.wait_samples_s + 600, t.rendezvous_s, t.wait_log_interval_s)
        self.parts, resumed = build_parts(self.cfg, self.run_dir, self.rank, self.world, self.startup)
        self._resume_or_start(resumed)
        log.info("training %d -> %d local updates on %d rank(s), R=%d groups each, K=%d, budget B=%d",
                 self.state.step, cfg.total_updates, self.world, cfg.groups_per_update,
                 cfg.async_training.trigger_parameter_sync_step, cfg.admission_budget)

    def shutdown(self, final_state: HeartbeatState) -> None:
        """Release what has threads of its own (rank 0's publisher); nothing to save: a checkpoint was taken at
        the last update boundary a stop or preemption asked for, and a restart resumes from the newest one."""
        if self.parts is not None:
            self.parts.close()

    def _resume_or_start(self, resumed: Optional[checkpoint.TrainerState]) -> None:
        """Continue from the checkpoint's state (or a fresh one): publish its version if the run directory
        lacks it, mark the update boundary, and checkpoint a fresh start at once."""
        self.state = resumed or checkpoint.TrainerState()
        missing = self.state.param_version not in self.lead.weights.published_versions() if self.rank == 0 else None
        with self.startup.step(f"publishing weight version {self.state.param_version}"):
            if share_json({"publish": missing})["publish"]:  # every rank: the gather of ZeRO-3 weights is collective
                self._publish(self.state.param_version)
            self._mark_update_boundary()
            self._last_checkpoint_step = self.state.step
            if resumed is None:
                self._checkpoint()
        if self.rank == 0:  # a resumed count may be below the record's: those groups are dropped again
            self.sampling.give_back(self.state.counters.get(M.DROPPED_FILTER_GROUPS, 0))
        self.heartbeat.update(state=HeartbeatState.WAITING_SAMPLES, step="", step_started_s=0.0)
        self.heartbeat.write()  # out of start-up now: the launcher's Ctrl-C waits for a checkpoint from here on

    # ---- steps
    def _newest_weights_bad(self) -> bool:
        """Rank 0, when the run directory changed: has a rollout job marked our newest version damaged?
        Then its readers fell back to an older version whose admission budget is spent, and
        only a new version (same weights, current ``consumed_groups``) lets them go on."""
        if not self.changes.changed("bad marker"):
            return False
        if not self.lead.weights.is_bad(self.state.param_version):
            return False
        log.error("weight version %d was found damaged by a rollout job (see %s); publishing the current "
                  "weights as version %d", self.state.param_version,
                  self.run_dir.weight_bad_marker(self.state.param_version), self.state.param_version + 1)
        return True

    def _next_batch(self) -> tuple[int, list[Group], Dropped, float]:
        """Every rank: (status, groups to train on, dropped groups, seconds waited); rank 0 reads."""
        if self.rank != 0:
            status, kept = share_groups(BATCH, None)
            if status == ABORT:
                raise RuntimeError("trainer rank 0 failed; this rank stops too (see rank 0's log)")
            return status, kept, {}, 0.0
        if self.watch.check() is not None:
            status = self.intake.stop_status()
            share_groups(status, None)
            return status, [], {}, 0.0
        try:
            status, kept, dropped, wait_s = self.intake.take(self.lead.reader, self.state, self._newest_weights_bad)
        except BaseException:
            share_groups(ABORT, None)
            raise
        share_groups(status, kept)
        return status, kept, dropped, wait_s

    def _update(self, groups: list[Group], version_seen: int) -> dict:
        """Train on the groups; lag is measured against ``version_seen``, the version this update starts from."""
        updater = self.parts.updater
        memory.reset_peaks()
        out = updater.run(build_batch(groups, self.parts.layout.pad_id, version_seen))
        self.state.kl_coef = updater.kl_coef
        return {**out, **memory.peaks()}

    def _gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the HF names (the value head stays in the trainer); a LoRA run: the adapter's
        alone, under peft's names."""
        engine = self.parts.engine
        if self.cfg.lora:
            return adapter_state_dict(engine.module, self.cfg.actor.zero_stage == 3, engine.global_rank)
        if self.cfg.actor.zero_stage == 3:  # a collective: one gather per layer, the tensors on rank 0 only
            state, gathers = zero3_state_dict(engine.module, engine.global_rank, POLICY_PREFIX)
            if not self._gathers_logged:
                self._gathers_logged = True
                log.info("ZeRO-3: the policy is gathered for each publish in %d groups (one per layer + the rest)",
                         gathers)
            return policy_state_dict(state)
        return policy_state_dict(engine.module.state_dict())

    def _publish(self, version: int) -> float:
        faults.point("publish")
        t0 = time.monotonic()
        state_dict = self._gathered_state_dict()
        gather_s = time.monotonic() - t0
        if self.parts.engine.global_rank == 0:
            weights = self.lead.weights
            budget_base = self.state.consumed_groups - self.state.counters.get(M.DROPPED_FILTER_GROUPS, 0)
            published = weights.publish(version, state_dict, self.parts.model_config_json, self.state.step,
                                        budget_base, self.parts.model_files, self.parts.adapter_base)
            self._sync_stats = {M.PARAM_SYNC_GATHER_S: gather_s, **published.metrics()}
            if self.cfg.trainer.simulated:
                self.parts.updater.after_publish()
            deleted = weights.retain(self.cfg.timeouts.heartbeat_stale_s)
            if deleted:
                log.debug("retention deleted versions %s", deleted)
        self.state.param_version = version
        self.heartbeat.update(param_version=version)
        return time.monotonic() - t0

    def _mark_update_boundary(self) -> None:
        """Record what a checkpoint taken from now on must hold: the state right after the
        last completed update (cursor just past its groups, log sizes). Groups taken for an
        update that never ran (USR2 arrived while waiting for the rest) stay unconsumed."""
        if self.rank == 0:
            self.state.cursor = self.lead.reader.cursor()
            self.state.metrics_bytes = log_size(self.run_dir.metrics)
            self.state.staleness_bytes = log_size(self.run_dir.staleness)
        self._boundary = self.state.to_json()  # a deep copy

    def _checkpoint(self) -> None:
        faults.point("checkpoint")
        # every rank saves rank 0's record (only rank 0 reads samples and writes logs)
        state = checkpoint.TrainerState.from_json(share_json(self._boundary))
        tag = checkpoint.save(self.parts.engine, self.run_dir, state, self.cfg.trainer.keep_checkpoints,
                              adapter_only=self.cfg.lora)
        log.info("checkpoint %s (version %d, %d groups consumed)", tag, state.param_version, state.consumed_groups)
        if self.rank == 0:  # the shards wholly behind this checkpoint's cursor are never read again
            removed = delete_consumed(self.run_dir, state.cursor, self.cfg.trainer.keep_consumed_shards,
                                      self._shards_removed)
            if removed:
                log.debug("removed %d consumed shard files (trainer.keep_consumed_shards)", removed)

    def _sync_row(self, sync_s: float) -> dict:
        """The last publish's sync metrics for an update that published; zeros (path ``none``) for one
        that did not, so every row has the same numeric columns (no NaN in metrics.jsonl)."""
        if sync_s:
            return self._sync_stats
        return {k: (0.0 if isinstance(v, (int, float)) else "none") for k, v in self._sync_stats.items()}

    def _log_update(self, kept: list[Group], dropped: Dropped, upd: dict, wait_s: float, update_s: float,
                    sync_s: float, version_seen: int) -> dict:
        """Staleness rows (lag against the version the trainer had when it took the groups) and one metrics row."""
        st, c = self.state, self.state.counters
        now = time.time()
        self.lead.staleness.write_groups(kept, version_seen, st.step, now)
        for reason, groups in dropped.items():
            self.lead.staleness.write_groups(groups, version_seen, st.step, now, dropped=reason)
        lags = [version_seen - g.version_start for g in kept]
        spans = [g.version_end - g.version_start for g in kept]
        stale = [g for g in kept if version_seen - g.version_start > 0]
        c[M.STALE_SAMPLES] = c.get(M.STALE_SAMPLES, 0) + len(stale)
        c[M.STALE_TRAJECTORIES] = (
            c.get(M.STALE_TRAJECTORIES, 0) + sum(len(g.trajectories) for g in stale))
        c[M.DROPPED_MAX_STALENESS] = c.get(M.DROPPED_MAX_STALENESS, 0) + len(dropped.get(MAX_STALENESS, ()))
        c[M.DROPPED_LAG_BOUND] = c.get(M.DROPPED_LAG_BOUND, 0) + len(dropped.get(LAG_BOUND, ()))
        if dropped.get(LAG_BOUND):
            log.warning("dropped %d group(s) whose newest token lags version %d by more than the lag bound %d: %s",
                        len(dropped[LAG_BOUND]), version_seen, self.cfg.max_lag_bound,
                        ", ".join(g.sample_id for g in dropped[LAG_BOUND][:5]))
        total_s = wait_s + update_s + sync_s
        for name in M.COUNTERS:  # every counter in every row, 0 until something is counted
            c.setdefault(name, 0)
        row = {M.STEP: st.step, M.PARAM_VERSION: version_seen, M.CONSUMED_GROUPS: st.consumed_groups,
               **upd, **c, M.LAG_MEAN: sum(lags) / len(lags), M.LAG_MAX: max(lags),
               M.PARTIAL_RATIO: sum(s > 0 for s in spans) / len(spans), M.MAX_PARTIAL_SPAN: max(spans),
               M.TRAINER_IDLE_RATIO: wait_s / max(total_s, 1e-9), M.WAIT_SAMPLES_S: wait_s,
               M.UPDATE_S: update_s, M.PARAM_SYNC_S: sync_s, **self._sync_row(sync_s),
               M.TOKENS_PER_S: upd[M.N_TOKENS] / max(total_s, 1e-9), M.TIME_S: now,
               M.NUM_GEN_BATCHES: self.sampling.gen_batches(len(kept) + count_dropped(dropped))}
        self.lead.metrics.write(row)
        self.heartbeat.update(stats=JobStats(step=st.step, consumed_groups=st.consumed_groups,
                                             reward_mean=upd[M.REWARD_MEAN], idle_ratio=row[M.TRAINER_IDLE_RATIO]))
        return row

    # ---- the loop
    def loop(self) -> Stop:
        """The update loop, one local update per iteration, as named steps:

        take R groups (:meth:`_next_batch`: waits for committed groups; while a rollout job
        is dead it logs the writers and their heartbeat ages, and fails after
        ``timeouts.wait_samples_s``) -> update -> log -> publish every K updates -> mark
        the update boundary -> checkpoint when due. Returns DONE, or PREEMPTED after USR2
        (checkpointed at the last completed update, then requeued), or STOPPED when the launcher asked the
        run to stop (Ctrl-C: checkpointed the same way, so a resume redoes nothing).
        """
        while self.state.step < self.cfg.total_updates:
            termination.check()
            version_seen = self.state.param_version
            status, kept, dropped, wait_s = self._next_batch()
            if status in (PREEMPT, STOP):
                self._checkpoint()  # the last completed update, on every rank
                return Stop.STOPPED if status == STOP else Stop.PREEMPTED
            if status == REPUBLISH:  # every rank: the gather of ZeRO-3 weights is collective
                self._publish(self.state.param_version + 1)
                continue
            with stack_dump_after(self.cfg.timeouts.stuck_update_s):
                upd, update_s = self._train_step(kept, dropped, version_seen)
                published = self._publish_due()
                sync_s = self._publish(version_seen + 1) if published else 0.0
                if self.rank == 0:
                    self._log_step(kept, dropped, upd, wait_s, update_s, sync_s, version_seen, published)
                self._mark_update_boundary()
                if published:
                    self._checkpoint_if_due()
        self._finish()
        return Stop.DONE

    def _train_step(self, kept: list[Group], dropped: Dropped, version_seen: int) -> tuple[dict, float]:
        """One local update on ``kept``; the dropped groups count as consumed too (those without spread also in
        their own counter, before the publish that follows: its budget base leaves them out)."""
        t0 = time.monotonic()
        upd = self._update(kept, version_seen)
        self.state.step += 1
        self.state.consumed_groups += len(kept) + count_dropped(dropped)
        c = self.state.counters
        c[M.DROPPED_FILTER_GROUPS] = c.get(M.DROPPED_FILTER_GROUPS, 0) + len(dropped.get(FILTERED, ()))
        return upd, time.monotonic() - t0

    def _publish_due(self) -> bool:
        """A version is published every K local updates, and after the last one."""
        K = self.cfg.async_training.trigger_parameter_sync_step
        return self.state.step % K == 0 or self.state.step == self.cfg.total_updates

    def _log_step(self, kept: list[Group], dropped: Dropped, upd: dict, wait_s: float, update_s: float,
                  sync_s: float, version_seen: int, published: bool) -> None:
        """Rank 0: the staleness and metrics rows, and a log line per published version."""
        row = self._log_update(kept, dropped, upd, wait_s, update_s, sync_s, version_seen)
        if published:
            log.info("v%d step %d/%d reward %.3f lag mean %.2f max %d idle %.2f; published in %.2fs (%s)",
                     self.state.param_version, self.state.step, self.cfg.total_updates, row[M.REWARD_MEAN],
                     row[M.LAG_MEAN], row[M.LAG_MAX], row[M.TRAINER_IDLE_RATIO], sync_s,
                     row.get(M.WEIGHTS_PATH, "filesystem"))

    def _checkpoint_if_due(self) -> None:
        """Right after a publish, every ``trainer.checkpoint_every_updates`` updates and at the end."""
        if (self.state.step - self._last_checkpoint_step >= self.cfg.trainer.checkpoint_every_updates
                or self.state.step == self.cfg.total_updates):
            self._checkpoint()
            self._last_checkpoint_step = self.state.step

    def _finish(self) -> None:
        """Rank 0: write ``trainer_done.json`` (rollout jobs stop, the launcher reports)."""
        if self.rank == 0:
            write_json_atomic(self.run_dir.trainer_done, TrainerDone(
                self.state.step, self.state.param_version, self.state.consumed_groups, time.time(),
                cursor=self.lead.reader.cursor()).to_json())
            bump(self.run_dir, "trainer done", "trainer")
            log.info("done: %d updates, version %d, %d groups consumed", self.state.step, self.state.param_version,
                     self.state.consumed_groups)


def trainer_main(run_dir: str) -> None:
    """A trainer rank's entry point (``hpcrl trainer RUN``): every job's life (``control/job.py``) around
    :class:`TrainerJob`. An earlier attempt's ranks on this node are ended first; a rank whose world cannot be
    found (no Slurm or launcher variables) ends with one line."""
    rank = rank_from_environment()

    def build(rd: RunDir, preemption: PreemptionFlag) -> TrainerJob:
        os.environ.update(rank_environment())  # LaunchError: one line, naming what was missing
        return TrainerJob(rd, preemption, rank, int(os.environ["WORLD_SIZE"]))

    job_main(run_dir, RunDir.trainer_job(), ("trainer",), build, log_name=RunDir.trainer_job(rank))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="hpcrl trainer job (normally started by `hpcrl run` or sbatch/)")
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    trainer_main(a.run_dir)


if __name__ == "__main__":
    main()
