"""The reward job (``hpcrl reward-job RUN --index I``): serves the reward model to every rollout job (and the
evaluation job) from its own allocation, beside the rollout fleet (verl's standalone reward-model pool).

Start-up: load the model (a start-up step; a model that cannot load is an input no restart fixes: the job writes
``control/fatal.json`` with input ``reward_model`` and every job of the run stops), then listen and write
``control/reward/<job>.json`` (``wire.py``: host, port, a fresh epoch; the clients find it there).

The loop (:meth:`RewardJob.loop`) repeats: **stop?** (USR2: close and requeue; the launcher's stop request or
another job's fatal record: close), **done?** (the trainer is done and no job that asks this one is left: the
evaluation job, when it scores with the model, has ended), **retired?** (``resources.reward_jobs`` of the frozen
config is now at most this job's index, ``hpcrl scale --reward-jobs``: end ``drained``), **report** (the heartbeat's counters; a row of
``logs/<job>.jsonl`` every :data:`ROW_EVERY_S`), **wait** a poll. Requests are answered meanwhile by the server's
threads (``server.py``).

Crash safety: the job holds no state. Killed at any instant (SIGKILL, a node failure, a preemption), the requests
in flight are lost and its clients send them again to another reward job, or to this one's successor once it has
written its new record (``client.py``); a group is committed only with all its scores, each from one complete
reply, so nothing is lost or scored twice into the trainer's batch. A clean end removes its record first, so no
client waits on a closed port.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import time
from typing import Optional

import torch

from hpcrl.control.changes import ChangeWatch, bump
from hpcrl.control.fatal import fatal_inputs
from hpcrl.control.job import Stop, StopWatch, job_main
from hpcrl.control.records import HeartbeatState, HeartbeatThread, JobStats, read_heartbeats
from hpcrl.control.startup import StartupSteps
from hpcrl.logs import metric_names as M
from hpcrl.logs.run_logs import MetricsLog
from hpcrl.process.preemption import PreemptionFlag
from hpcrl.reward.models import RewardModel, load_reward_model
from hpcrl.reward.scoring import eval_scores_with_model
from hpcrl.reward.server import RewardServer
from hpcrl.reward.wire import RewardService, read_run_secret
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.paths import EVAL_JOB, RunDir
from hpcrl.tiny.model import load_tokenizer

log = logging.getLogger("hpcrl.reward")

ROW_EVERY_S = 60.0
"""A row of ``logs/<job>.jsonl`` this often (and a last one at the end)."""
POLL_S = 0.5


class RewardJob:
    """One reward job (module docstring); its steps run in every job's frame (``control/job.py``)."""

    def __init__(self, run_dir: RunDir, index: int, preemption: Optional[PreemptionFlag] = None):
        if index < 0:
            raise ValueError(f"reward job index {index} must be >= 0")
        self.run_dir = run_dir
        self.cfg = run_dir.load_config()
        self.job = RunDir.reward_job(index)
        self.name = f"the reward job {self.job}"
        self.requeues = True
        self.index = index
        self.changes = ChangeWatch(run_dir, self.cfg.timeouts.poll_interval_s, self.cfg.timeouts.poll_max_s)
        """Whether the run directory may have changed: the stop records and the reward jobs' number are looked at
        then (``control/changes.py``)."""
        self.watch = StopWatch(run_dir, preemption, {
            Stop.PREEMPTED: "closing the service (its clients send their requests elsewhere) and requeueing",
            Stop.STOPPED: "closing the service", Stop.DONE: "closing the service"}, changes=self.changes)
        t = self.cfg.timeouts
        self.heartbeat = HeartbeatThread(run_dir, self.job, "reward", t.heartbeat_interval_s)
        self.startup = StartupSteps(self.heartbeat, self.job, t.job_start_s)
        self.model: Optional[RewardModel] = None
        self.server: Optional[RewardServer] = None
        self.record: Optional[RewardService] = None
        """This process's service record (removed at the end if it is still the one on disk)."""
        self.metrics: Optional[MetricsLog] = None
        self._row_s = time.monotonic()

    def start(self) -> None:
        """Load the model (fatal if it cannot), listen, announce (module docstring)."""
        cfg, rd, t = self.cfg, self.run_dir, self.cfg.timeouts
        rm = cfg.reward_model
        folder = rd.reward_model_dir(rm.path)
        with self.startup.step(f"loading the reward model {folder}", t.job_start_s + t.engine_start_s):
            with fatal_inputs(rd, self.job, f"loading the reward model {folder}", "reward_model"):
                policy_tokenizer = load_tokenizer(rd.model_dir(cfg.model.path))
                torch.set_num_threads(rm.torch_threads)
                self.model = load_reward_model(cfg, folder, policy_tokenizer)
        log.info("serving %s", self.model.describe())
        epoch = secrets.token_hex(8)
        self.server = RewardServer(self.model, read_run_secret(rd), self.job, epoch)
        self.record = RewardService(job=self.job, host=socket.gethostname(), port=self.server.port, epoch=epoch,
                                    pid=os.getpid(), kind=self.model.kind, created_s=time.time())
        rd.reward_service().mkdir(parents=True, exist_ok=True)
        write_json_atomic(rd.reward_service(self.job), self.record.to_json())
        bump(rd, "reward", self.job)
        log.info("listening at %s (epoch %s); announced in %s", self.record.address, epoch,
                 rd.reward_service(self.job))
        self.metrics = MetricsLog(rd.reward_metrics(self.job))
        self.heartbeat.update(state=HeartbeatState.SERVING, step="", step_started_s=0.0, stats=self._stats())
        self.heartbeat.write()

    def _stats(self) -> JobStats:
        s = self.server.stats
        return JobStats(items_scored=s.items, idle_ratio=round(s.idle_share(), 4))

    def _row(self) -> dict:
        s = self.server.stats
        with s.lock:
            return {M.TIME_S: time.time(), "job": self.job, M.REWARD_JOB_ITEMS: s.items,
                    M.REWARD_JOB_REQUESTS: s.requests, M.REWARD_JOB_IDLE_RATIO: round(s.idle_share(), 4),
                    M.REWARD_JOB_ITEMS_PER_S: s.items / s.model_s if s.model_s > 0 else 0.0,
                    M.REWARD_JOB_QUEUE_MAX: s.queue_max}

    def _done(self) -> bool:
        """The trainer is done and no client is left (module docstring)."""
        if not self.run_dir.trainer_done.exists():
            return False
        if not (self.cfg.eval.enabled and eval_scores_with_model(self.cfg)):
            return True
        beat = read_heartbeats(self.run_dir).get(EVAL_JOB)
        return beat is None or beat.state == HeartbeatState.DONE.value or (
            beat.ended and beat.age_s(time.time()) > self.cfg.timeouts.heartbeat_stale_s)

    def _retired(self) -> bool:
        """The reward jobs were made fewer (``hpcrl scale --reward-jobs``): this one is beyond their number."""
        try:
            n = self.run_dir.load_config().resources.reward_jobs
        except (OSError, ValueError) as e:  # a config being replaced: look again at the next change
            log.warning("could not read the frozen config for the number of reward jobs: %s", e)
            return False
        if n <= self.index:
            log.info("resources.reward_jobs is %d now: %s ends (its clients go to the others)", n, self.job)
        return n <= self.index

    def loop(self) -> Stop:
        """Stop?, done?, report, wait (module docstring)."""
        while True:
            stop = self.watch.check()
            if stop is not None:
                return stop
            if self._done():
                log.info("the trainer is done and no job needs the reward model any more")
                return Stop.DONE
            if self.changes.changed("retired") and self._retired():
                return Stop.DRAINED
            self.heartbeat.update(stats=self._stats())
            if time.monotonic() - self._row_s >= ROW_EVERY_S:
                self._row_s = time.monotonic()
                self.metrics.write(self._row())
            time.sleep(POLL_S)

    def shutdown(self, final_state: HeartbeatState) -> None:
        """Withdraw the record (if still ours), close the server and the model, write the last row."""
        try:
            if self.record is not None:
                path = self.run_dir.reward_service(self.job)
                on_disk = read_json(path)
                if isinstance(on_disk, dict) and on_disk.get("epoch") == self.record.epoch:
                    path.unlink(missing_ok=True)
                    bump(self.run_dir, "reward", self.job)
            if self.server is not None:
                self.server.close()
                if self.metrics is not None:
                    self.metrics.write(self._row())
                    self.metrics.close()
        finally:
            if self.model is not None:
                self.model.close()
            items = self.server.stats.items if self.server is not None else 0
            log.info("%s %s: %d responses scored", self.name, final_state, items)


def reward_main(run_dir: str, index: int) -> None:
    """A reward job's entry point (``hpcrl reward-job RUN --index I``, the launcher, ``sbatch/reward.sbatch``): every
    job's life (``control/job.py``) around :class:`RewardJob`."""
    job_main(run_dir, RunDir.reward_job(index), ("reward-job", "--index", str(index)),
             lambda rd, preemption: RewardJob(rd, index, preemption))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="hpcrl reward job (normally started by `hpcrl run` or sbatch/)")
    p.add_argument("run_dir")
    p.add_argument("--index", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)))
    a = p.parse_args(argv)
    reward_main(a.run_dir, a.index)


if __name__ == "__main__":
    main()
