"""Config sections that may change on a live run (``hpcrl run --resume RUN key=value``): how long each
wait may last (``timeouts``) and what the jobs and the launcher log (``logging``). One dataclass
each, a docstring under every field; ``validate()`` names the key, what is allowed and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hpcrl.config import names
from hpcrl.config.checks import check_choice, check_float, check_int, fail


@dataclass
class TimeoutsConfig:
    """``timeouts``: every wait's limit, heartbeats and polling."""

    wait_samples_s: float = 600.0
    """Trainer gives up (exit 1, naming the writers and their last heartbeats)
    after waiting this long for the next group."""
    wait_weights_s: float = 600.0
    """Rollout gives up after waiting this long for a new weight version."""
    heartbeat_interval_s: float = 2.0
    """How often each job rewrites its heartbeat record."""
    heartbeat_stale_s: float = 60.0
    """A heartbeat older than this marks its job as dead (its loading
    announcements no longer protect weight versions; a rollout writer's prompt
    claims are reclaimed by the other writers once its job has ended too:
    control/reclaim.py)."""
    poll_interval_s: float = 0.05
    """Sleep between polls of the run directory, right after something changed."""
    poll_max_s: float = 0.5
    """While nothing changes, a job's polls of the run directory back off from ``poll_interval_s`` to this, each
    sleeping a quarter of the time waited so far (``control/changes.py``; the trainer's look for new samples too):
    a change is seen at most this late, and at most a quarter of the wait late.
    Lower reacts faster and costs the filesystem's metadata server more operations per second."""
    wait_log_interval_s: float = 10.0
    """A job that waits for the other one logs what it waits for this often."""
    job_start_s: float = 900.0
    """Every start-up step of a job (building DeepSpeed's ops, loading the model, a checkpoint, the first
    version) must end in this long, or the job stops with one line naming the step (a restart may fix a stuck
    node or filesystem); the step shows in the heartbeat and ``hpcrl status`` meanwhile."""
    rendezvous_s: float = 300.0
    """Trainer ranks wait this long for each other at start (after the op build): past it, rank 0 ends the job
    with one line naming the ranks that did not arrive, and the others name the master they waited for. Keep it
    below ``job_start_s``, the limit of every start-up step (this one too), or that limit ends the job first
    with a line naming only the step."""
    engine_start_s: float = 900.0
    """Rollout gives up if its engine has not started in this long (vLLM compiles and
    profiles memory at start; a first start on a fresh node was once seen to sit for minutes)."""
    generate_s: float = 1800.0
    """Rollout gives up if one group's generation (or a weight load into the engine) takes longer."""
    broadcast_connect_s: float = 5.0
    """Weight broadcast: each step of joining (rendezvous, secret handshake) waits this long; a
    rollout job also waits this long for the broadcast header of a version before reading the files."""
    broadcast_s: float = 120.0
    """Weight broadcast: forming the group, sending one version's buckets and the acknowledgements must
    end in this long; a peer that misses it is dropped (trainer) or reads the version from files (rollout)."""
    retry_failed_load_s: float = 30.0
    """After its engine failed to load a (verified) version, a rollout job stays on its version and
    tries that one again after this long (a newer version is tried at once)."""
    stop_s: float = 300.0
    """Ctrl-C (or SIGTERM) to ``hpcrl run``, or a job's error no restart can fix (``control/fatal.json``): the jobs
    stop by themselves, the trainer checkpoints its last completed update (so a resume redoes nothing) and the
    rollout jobs seal their complete groups; a job still starting is cancelled at once. After this long the
    launcher cancels what is left and waits for it to end (SIGKILL 30 s after a SIGTERM it ignored). A second
    Ctrl-C cancels at once."""
    disk_full_s: float = 300.0
    """A job whose write to the run directory meets a full disk or quota (ENOSPC, EDQUOT) says so in one line
    (which path, how many bytes, how much is free) and waits for space with back-off this long, then ends with
    a fatal record (``hpcrl status``: "disk full at ..."; free space, then ``hpcrl run --resume``). Keep it below
    wait_samples_s and wait_weights_s, so the other jobs outwait it."""
    slow_write_s: float = 10.0
    """A write to the run directory (with its fsync) slower than this is named in the job's log."""
    stuck_update_s: float = 1800.0
    """A trainer update (with its publish and checkpoint) still running after this long writes every thread's
    stack to the job's stderr (its Slurm output), once, and goes on: where a collective that one rank never joins
    waits. 0: never."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        for name in ("wait_samples_s", "wait_weights_s", "heartbeat_interval_s", "heartbeat_stale_s",
                     "poll_interval_s", "poll_max_s", "wait_log_interval_s", "job_start_s", "rendezvous_s",
                     "engine_start_s", "generate_s", "retry_failed_load_s", "broadcast_connect_s", "broadcast_s", "stop_s",
                     "disk_full_s", "slow_write_s"):
            check_float(f"timeouts.{name}", getattr(self, name), 0.0, lo_open=True)
        check_float("timeouts.stuck_update_s", self.stuck_update_s, 0.0)
        if self.poll_max_s < self.poll_interval_s:
            fail("timeouts.poll_max_s", self.poll_max_s,
                 f">= timeouts.poll_interval_s = {self.poll_interval_s} (the back-off starts there)")
        if self.heartbeat_stale_s <= 2 * self.heartbeat_interval_s:
            fail("timeouts.heartbeat_stale_s", self.heartbeat_stale_s,
                  f"more than 2 * timeouts.heartbeat_interval_s = {2 * self.heartbeat_interval_s}")


@dataclass
class LoggingConfig:
    """``logging``: the jobs' log level and where the trainer's metrics go."""

    level: str = "INFO"
    """Python logging level of both jobs."""
    backends: list = field(default_factory=lambda: ["jsonl"])
    """Metric sinks of the trainer and the evaluation job (verl: trainer.logger): ``jsonl`` (always
    written, logs/metrics.jsonl, logs/eval.jsonl), ``tensorboard`` (logs/tensorboard/), ``wandb``
    (logs/wandb/). The same metric names go to each."""
    project: str = "hpcrl"
    """Project name of the TensorBoard/W&B run (verl: trainer.project_name)."""
    experiment_name: Optional[str] = None
    """Run name in W&B (verl: trainer.experiment_name); null = the run directory's name."""
    wandb_mode: str = "offline"
    """``offline`` writes the W&B run under logs/wandb/ with no network (upload later with
    ``wandb sync``); ``online`` streams it (needs network and a login on the trainer node)."""
    show_samples: int = 10
    """``hpcrl run`` shows one sampled response (prompt, response, reward, cut to a line) under every
    this many version lines (0: never); ``hpcrl samples RUN`` shows more (verl: log_val_generations)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("logging.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        for b in self.backends:
            check_choice("logging.backends", b, names.LOGGING_BACKENDS)
        check_choice("logging.wandb_mode", self.wandb_mode, names.WANDB_MODES)
        check_int("logging.show_samples", self.show_samples, 0)
