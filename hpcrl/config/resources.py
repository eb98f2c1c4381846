"""Config of the jobs' sizes and Slurm options (``resources``), per role."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.config.checks import check_float, check_int, fail

@dataclass
class JobResources:
    """The size and Slurm options of one job (``resources.trainer``, ``resources.rollout``, ``resources.eval``,
    ``resources.reward``)."""

    nodes: int = 1
    """Nodes for this job."""
    tasks_per_node: int = 1
    """Processes per node (trainer: DeepSpeed ranks; rollout: must be 1)."""
    cpus_per_task: int = 1
    """CPU cores per process."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU)."""
    mem_gb: int = 4
    """Memory per node in GB."""
    gpu_memory_gib: Optional[float] = None
    """Memory of one GPU of this job's nodes, GiB (80 for an H100 SXM, 141 for an H200; null: not known). For the
    trainer, ``hpcrl run`` (and its dry run) and ``hpcrl plan`` predict the peak per GPU from the config and the
    model's config.json and refuse a config that cannot fit, naming the largest term and the settings that would
    make it fit (hpcrl/plan/memory.py; docs/long-responses.md)."""
    timeout_min: int = 60
    """Wall-clock limit in minutes (Slurm --time). The job gets USR2 90 s before it."""
    partition: Optional[str] = None
    """Slurm partition (null: the cluster's default)."""
    account: Optional[str] = None
    """Slurm account to charge (null: your default)."""
    qos: Optional[str] = None
    """Slurm QOS (null: the default)."""
    constraint: Optional[str] = None
    """Slurm node features, e.g. ``a100`` (null: any node)."""
    sbatch_extra: dict = field(default_factory=dict)
    """Other sbatch options as {option: value}, e.g. {exclusive: "", reservation: "rl"} -> --exclusive --reservation=rl."""
    setup: list = field(default_factory=list)
    """Shell lines run in the job before hpcrl starts (module load ..., source venv/bin/activate)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def validate(self, prefix: str) -> None:
        """Raise ConfigError naming ``prefix.<field>`` for a value out of range."""
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "mem_gb", "timeout_min"):
            check_int(f"{prefix}.{name}", getattr(self, name), 1)
        check_int(f"{prefix}.gpus_per_node", self.gpus_per_node, 0)
        if self.gpu_memory_gib is not None:
            check_float(f"{prefix}.gpu_memory_gib", self.gpu_memory_gib, 0.0, lo_open=True)
        for name in ("partition", "account", "qos", "constraint"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
                fail(f"{prefix}.{name}", v, "null or a single word", "quote nothing, no spaces")
        for k, v in self.sbatch_extra.items():
            if not isinstance(k, str) or not k or k.startswith("-") or any(c.isspace() for c in k):
                fail(f"{prefix}.sbatch_extra", k, "option names without leading dashes, e.g. reservation")
            if not isinstance(v, (str, int, float)):
                fail(f"{prefix}.sbatch_extra.{k}", v, "a string or number ('' for a flag)")
        if not all(isinstance(line, str) for line in self.setup):
            fail(f"{prefix}.setup", self.setup, "a list of shell lines (strings)")


@dataclass
class PreemptibleRollout:
    """``resources.rollout_preemptible``: rollout jobs beyond a floor run on preemptible capacity (a scavenger
    partition or QOS that any job may use until its owner needs it back). On preemption Slurm sends SIGTERM
    (after the partition's GraceTime) and SIGKILL KillWait later: the job seals its complete groups and saves
    those in flight within seconds, and its requeued successor (same job and array task id: the same writer)
    regenerates its uncommitted prompt claims and continues the saved groups, so nothing is lost."""

    partition: Optional[str] = None
    """Slurm partition of the preemptible capacity (null, with ``qos`` null: off; every rollout job is
    submitted as ``resources.rollout`` says)."""
    qos: Optional[str] = None
    """Slurm QOS of the preemptible capacity (null: ``resources.rollout.qos``)."""
    floor: int = 1
    """Rollout jobs that are never preempted: writers ``0..floor-1`` are submitted as ``resources.rollout`` says,
    writers from ``floor`` on (at launch and when ``hpcrl scale`` grows the fleet) with the partition and QOS above;
    they keep the run moving when the preemptible capacity is taken back."""
    requeue: bool = True
    """``--requeue``: Slurm puts a preempted job back in its queue under the same id (the same writer comes back
    when capacity returns). false: ``--no-requeue``; the launcher following the run resubmits it instead
    (``resources.max_restarts``)."""

    @property
    def enabled(self) -> bool:
        """Preemptible capacity is configured."""
        return self.partition is not None or self.qos is not None

    def validate(self) -> None:
        """Raise ConfigError naming ``resources.rollout_preemptible.<field>`` for a value out of range."""
        for name in ("partition", "qos"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
                fail(f"resources.rollout_preemptible.{name}", v, "null or a single word", "no spaces")
        check_int("resources.rollout_preemptible.floor", self.floor, 1)
        if not isinstance(self.requeue, bool):
            fail("resources.rollout_preemptible.requeue", self.requeue, "true or false")


@dataclass
class RolloutAutoscale:
    """``resources.rollout_autoscale``: the launcher following the run grows or shrinks the rollout fleet by one job
    at a time from the measured idle ratios (opt-in: off while ``max_jobs`` is 0). Every decision is one line in
    the launcher's output with its numbers."""

    min_jobs: int = 1
    """The fleet never shrinks below this."""
    max_jobs: int = 0
    """The fleet never grows beyond this (0: autoscale off)."""
    idle_ratio: float = 0.3
    """Trainer idle above it in each of the last ``versions`` updates: add a rollout job; every rollout job idle
    above it over those versions: drain the newest."""
    versions: int = 5
    """How many versions the rule looks at, and waits after a decision before the next one."""
    start_within_s: float = 300.0
    """Under Slurm a job is added only if the queue can start it soon: no rollout job of the fleet is still
    pending, and ``sbatch --test-only`` with the rollout job's options expects it to start within this many
    seconds. Held otherwise (the decision is logged with what the queue said). The local executor always can."""

    @property
    def enabled(self) -> bool:
        """Autoscale is on."""
        return self.max_jobs > 0

    def validate(self) -> None:
        """Raise ConfigError naming ``resources.rollout_autoscale.<field>`` for a value out of range."""
        check_int("resources.rollout_autoscale.min_jobs", self.min_jobs, 1)
        check_int("resources.rollout_autoscale.max_jobs", self.max_jobs, 0)
        check_int("resources.rollout_autoscale.versions", self.versions, 1)
        if self.enabled and self.max_jobs < self.min_jobs:
            fail("resources.rollout_autoscale.max_jobs", self.max_jobs,
                 f">= resources.rollout_autoscale.min_jobs = {self.min_jobs}, or 0 (off)")
        if not isinstance(self.start_within_s, (int, float)) or isinstance(self.start_within_s, bool) \
                or not self.start_within_s > 0:
            fail("resources.rollout_autoscale.start_within_s", self.start_within_s,
                 "seconds > 0, e.g. 300 (how soon the queue must be able to start an added rollout job)")
        if not isinstance(self.idle_ratio, (int, float)) or not 0 < self.idle_ratio < 1:
            fail("resources.rollout_autoscale.idle_ratio", self.idle_ratio, "a ratio in (0, 1), e.g. 0.3")


@dataclass
class ResourcesConfig:
    """``resources``: the jobs' sizes, how many rollout jobs, and the restart budget."""

    trainer: JobResources = field(default_factory=JobResources)
    """Resources of the trainer job (nodes * tasks_per_node DeepSpeed ranks)."""
    rollout: JobResources = field(default_factory=JobResources)
    """Resources of each rollout job."""
    eval: JobResources = field(default_factory=JobResources)
    """Resources of the evaluation job (only submitted when ``eval.every_versions`` > 0)."""
    reward: JobResources = field(default_factory=JobResources)
    """Resources of each reward job (``reward_model.placement: job``)."""
    reward_jobs: int = 1
    """Number of reward jobs serving the reward model (``reward_model.placement: job``; verl:
    ``reward.reward_model.nnodes``, one job per node). Rollout jobs spread their requests over them by load."""
    rollout_jobs: int = 1
    """Number of rollout jobs (each one sample writer; a Slurm job array in sbatch/). ``hpcrl scale`` changes it on
    a live run."""
    rollout_preemptible: PreemptibleRollout = field(default_factory=PreemptibleRollout)
    """Rollout jobs beyond a floor on preemptible capacity (off unless a partition or QOS is given)."""
    rollout_autoscale: RolloutAutoscale = field(default_factory=RolloutAutoscale)
    """The launcher changes the fleet size from the idle ratios (off unless ``max_jobs`` is set)."""
    max_restarts: int = 3
    """The launcher resubmits a job that ended before the trainer finished (crash,
    scancel, node failure; the evaluation job: before it evaluated the final version) at most
    this many times per job; then the run fails (an evaluation job's: training goes on without it)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        self.trainer.validate("resources.trainer")
        self.rollout.validate("resources.rollout")
        self.eval.validate("resources.eval")
        self.reward.validate("resources.reward")
        check_int("resources.reward_jobs", self.reward_jobs, 0)
        check_int("resources.rollout_jobs", self.rollout_jobs, 1)
        self.rollout_preemptible.validate()
        self.rollout_autoscale.validate()
        check_int("resources.max_restarts", self.max_restarts, 0)
        if self.rollout.world_size != 1:
            fail("resources.rollout.tasks_per_node", self.rollout.tasks_per_node,
                  "1 task on 1 node per rollout job", "add capacity with resources.rollout_jobs instead")
        if self.eval.world_size != 1:
            fail("resources.eval.tasks_per_node", self.eval.tasks_per_node, "1 task on 1 node for the evaluation "
                 "job", "give it more GPUs per node (vLLM's tensor_parallel_size) instead")
        if self.reward.world_size != 1:
            fail("resources.reward.tasks_per_node", self.reward.tasks_per_node, "1 task on 1 node per reward job",
                 "add capacity with resources.reward_jobs instead")



    def rollout_for(self, writer_id: int) -> JobResources:
        """The resources of writer ``writer_id``'s rollout job: ``rollout``, with the preemptible partition, QOS and
        requeue from ``rollout_preemptible.floor`` on."""
        pre = self.rollout_preemptible
        if not pre.enabled or writer_id < pre.floor:
            return self.rollout
        extra = {k: v for k, v in self.rollout.sbatch_extra.items() if k not in ("requeue", "no-requeue")}
        extra["requeue" if pre.requeue else "no-requeue"] = ""
        return dataclasses.replace(self.rollout, partition=pre.partition or self.rollout.partition,
                                   qos=pre.qos or self.rollout.qos, sbatch_extra=extra)
