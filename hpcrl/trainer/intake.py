"""Rank 0 of the trainer takes the R groups of each update from the committed shards (:class:`GroupIntake`).

In commit order, as the sample reader hands them out: a group whose newest token lags by more than the lag bound
(the rollout jobs' commit check keeps those out) or whose oldest is over ``max_staleness`` is dropped and counted,
one without spread is dropped under ``algorithm.filter_groups`` (its admission place given back at once), all sorted
by ``dynamic_sampling.sort_taken``; skipped shards are counted; the reader's looks are paced so that they cost the
metadata server at most :data:`TRAINER_STATS_PER_S` stats a second; the wait has ``timeouts.wait_samples_s`` as its
deadline and a log line every ``timeouts.wait_log_interval_s`` naming the writers' heartbeats. A stop, a preemption
or a damaged newest weight version interrupts it (the groups taken so far wait for the next call).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from hpcrl.config import RunConfig
from hpcrl.control.changes import backoff_s, bump
from hpcrl.control.fatal import write_fatal
from hpcrl.control.job import Stop, StopWatch
from hpcrl.control.records import HeartbeatState, describe_heartbeats
from hpcrl.logs import metric_names as M
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import SampleReader
from hpcrl.samples.schema import Group
from hpcrl.trainer.checkpoint import TrainerState
from hpcrl.trainer.dynamic_sampling import Dropped, DynamicSampling, count_dropped, describe_dropped, sort_taken
from hpcrl.trainer.share import BATCH, PREEMPT, REPUBLISH, STOP

log = logging.getLogger("hpcrl.trainer")

TRAINER_STATS_PER_S = 2000
"""The trainer's look for new samples stats every writer's manifest; its looks are spaced so that this many stats
a second is the most they cost the filesystem's metadata server (Lustre's is quoted at 10^4-10^5 operations/s)."""
SAMPLE_LOOK_MAX_S = 0.2
"""While no group is committed, the trainer's looks back off to at most this far apart (``timeouts.poll_max_s`` if
lower; the spacing above if higher): a trainer waiting for its last groups is idle for that long at most (backing
off to 0.5 s cost 0.17 s per update of 2.9 s in bench/bench_scale.py)."""


class GroupIntake:
    """Rank 0's taking of each update's groups (module docstring); its only state is what a republish interrupted."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, watch: StopWatch, heartbeat, sampling: DynamicSampling):
        self.cfg, self.run_dir, self.watch, self.heartbeat, self.sampling = cfg, run_dir, watch, heartbeat, sampling
        self._taken: tuple[list[Group], Dropped] = ([], {})  # kept/dropped while a republish interrupts

    def take(self, reader: SampleReader, state: TrainerState, weights_bad: Callable[[], bool]
             ) -> tuple[int, list[Group], Dropped, float]:
        """(BATCH, R groups to train on, those dropped (for lag, for staleness, for no spread), seconds waited) from
        ``reader``, for the update that starts from ``state``; (PREEMPT or STOP, ...) if USR2 or a stop arrived
        meanwhile, or dynamic sampling took its last batch in vain (recorded as fatal); (REPUBLISH, ...) if
        ``weights_bad()`` says a rollout job marked our newest weight version damaged (the groups taken so far wait
        for the next call)."""
        cfg = self.cfg
        need = cfg.groups_per_update
        kept, dropped = self._taken
        self._taken = ([], {})
        t0 = time.monotonic()
        last_log = quiet_since = taken_since = t0
        while len(kept) < need:
            if self.watch.check() is not None:
                return self.stop_status(), [], dropped, time.monotonic() - t0
            if weights_bad():
                self._taken = (kept, dropped)
                return REPUBLISH, [], {}, time.monotonic() - t0
            lines = reader.lines_seen
            reader.poll()
            if reader.lines_seen > lines:
                quiet_since = time.monotonic()
            sleep_s = self._pause(reader, time.monotonic() - quiet_since)
            self._count_skipped(reader, state)
            room = self.sampling.room(len(kept) + count_dropped(dropped))
            taken = reader.take(min(need - len(kept), room))
            if taken:  # a group dropped is progress too: the wait is for the next group (timeouts.wait_samples_s)
                taken_since = time.monotonic()
            sort_taken(taken, kept, dropped, state.param_version, cfg, self.sampling,
                       state.counters.get(M.DROPPED_FILTER_GROUPS, 0))
            cause = self.sampling.exhausted(len(kept) + count_dropped(dropped), len(kept), state.step)
            if cause is not None:
                log.error("stopping the run: %s", cause)
                write_fatal(self.run_dir, RunDir.trainer_job(), cause, "data")
                self.watch.check()  # says why the trainer stops, as for any fatal record
                return STOP, [], dropped, time.monotonic() - t0
            if len(kept) >= need:
                break
            waited = time.monotonic() - t0
            if time.monotonic() - taken_since > cfg.timeouts.wait_samples_s:
                raise TimeoutError(f"trainer: waited {waited:.0f}s for committed groups in {self.run_dir.samples} "
                                   f"(have {len(kept)}/{need}, none new for {time.monotonic() - taken_since:.0f}s; "
                                   f"{describe_heartbeats(self.run_dir, 'rollout')})")
            if time.monotonic() - last_log > cfg.timeouts.wait_log_interval_s:
                log.info("waiting %.0fs for committed groups (%d/%d%s) in %s; %s", waited, len(kept), need,
                         describe_dropped(dropped), self.run_dir.samples, describe_heartbeats(self.run_dir, "rollout"))
                last_log = time.monotonic()
            self.heartbeat.update(state=HeartbeatState.WAITING_SAMPLES)
            time.sleep(sleep_s)
        self.heartbeat.update(state=HeartbeatState.TRAINING)
        return BATCH, kept, dropped, time.monotonic() - t0

    def _pause(self, reader: SampleReader, quiet_s: float) -> float:
        """Seconds until the next look for samples, ``quiet_s`` after the last look that found some. Each
        look stats every writer's manifest, so looks are at least ``writers / TRAINER_STATS_PER_S`` apart (0.38 s
        for 768 writers, 0.05 s up to 100); from there they back off while nothing is committed
        (``control.changes.backoff_s``), up to :data:`SAMPLE_LOOK_MAX_S`."""
        t = self.cfg.timeouts
        floor_s = min(max(t.poll_interval_s, reader.writers_seen / TRAINER_STATS_PER_S), t.poll_max_s)
        return backoff_s(quiet_s, floor_s, max(floor_s, min(SAMPLE_LOOK_MAX_S, t.poll_max_s)))

    def stop_status(self) -> int:
        """The status that tells every rank why the run stops (the watch has a reason)."""
        return STOP if self.watch.seen == Stop.STOPPED else PREEMPT

    def _count_skipped(self, reader: SampleReader, state: TrainerState) -> None:
        """Skipped shards, counted and announced (their writers and admission look)."""
        if reader.skipped:  # recorded in control/skipped_shards.jsonl: their writers and admission look
            bump(self.run_dir, f"{len(reader.skipped)} shard(s) skipped", "trainer")
        while reader.skipped:
            s = reader.skipped.pop(0)  # not consumed: recorded, its budget returned, its prompts regenerated
            c = state.counters
            c[M.CORRUPT_GROUPS_SKIPPED] = c.get(M.CORRUPT_GROUPS_SKIPPED, 0) + s["n_groups"]
