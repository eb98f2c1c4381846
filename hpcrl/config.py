"""Typed run configuration: one dataclass per component, checked before any job starts.

A config is a YAML file (``configs/*.yaml``) plus dotted command-line overrides
(``async_training.staleness_threshold=0.5``). Unknown keys are errors, every
value is range-checked by :meth:`RunConfig.validate`, and the resolved config is
frozen into the run directory as ``config.yaml`` at launch; both jobs read that
frozen copy, never the user's file.

Every default lives in these dataclasses, once (the ``algorithm`` and ``critic``
sections in :mod:`hpcrl.config_algorithm`, re-exported here). The async knobs
keep verl's names (``fully_async_policy``) so users can move their settings across.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from hpcrl.config_algorithm import AlgorithmConfig, CriticConfig, KLControlConfig, RolloutCorrectionConfig  # noqa: F401
from hpcrl.config_checks import ConfigError, _bad, _check_choice, _check_float, _check_int  # noqa: F401 (ConfigError is public here)


@dataclass
class ModelConfig:
    path: str = "builtin:tiny"
    """A local Hugging Face model folder (config.json, weights, tokenizer), or
    ``builtin:tiny`` to build the tiny Qwen2-style model and tokenizer locally
    at launch (nothing is downloaded)."""
    seed: int = 0
    """Seed for building ``builtin:tiny`` (random init) and for the trainer."""

    def validate(self) -> None:
        if self.path != "builtin:tiny":
            p = Path(self.path)
            if not (p / "config.json").is_file():
                raise _bad("model.path", self.path, "'builtin:tiny' or a local HF folder containing config.json",
                           "point model.path at a folder made by save_pretrained()")
        _check_int("model.seed", self.seed, 0)


@dataclass
class DataConfig:
    source: str = "builtin:toy"
    """``builtin:toy`` (the generated toy task) or a local ``.jsonl`` / ``.parquet``
    file with one prompt per row."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (files only)."""
    answer_key: str = "answer"
    """Column handed to the reward function as the reference answer (files only;
    may be absent if the reward does not need it)."""
    seed: int = 0
    """Seed of the prompt order; each epoch is a new permutation of it."""
    toy_num_prompts: int = 512
    """Number of distinct prompts the toy generator makes (builtin:toy only)."""

    def validate(self) -> None:
        if self.source != "builtin:toy":
            p = Path(self.source)
            if p.suffix not in (".jsonl", ".parquet"):
                raise _bad("data.source", self.source, "'builtin:toy' or a .jsonl/.parquet file")
            if not p.is_file():
                raise _bad("data.source", self.source, "an existing file", "check the path (it is read on the rollout node)")
        _check_int("data.seed", self.seed, 0)
        _check_int("data.toy_num_prompts", self.toy_num_prompts, 1)


@dataclass
class RewardConfig:
    name: str = "toy_copy"
    """Name of a rule-based reward in ``hpcrl.rollout.rewards.REWARDS``."""

    def validate(self) -> None:
        from hpcrl.rollout.rewards import REWARDS

        _check_choice("reward.name", self.name, tuple(sorted(REWARDS)))


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 4
    """Groups (prompts) per optimizer step (verl: ppo_mini_batch_size)."""
    ppo_micro_batch_size: int = 4
    """Groups per forward/backward on each trainer rank; gradient accumulation covers
    the rest of the rank's share of the mini-batch."""
    ppo_epochs: int = 1
    """Passes over each local batch of R groups."""
    lr: float = 1e-3
    """Adam learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio: float = 0.2
    """PPO clip epsilon: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio]."""
    clip_ratio_low: Optional[float] = None
    """Lower clip epsilon (null = clip_ratio): the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: Optional[float] = None
    """Upper clip epsilon (null = clip_ratio; DAPO's clip-higher uses e.g. 0.28)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip bound c > 1: for tokens with negative advantage the loss is at most
    -A * c (null = plain PPO clip)."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean`` (over the mini-batch; see hpcrl/trainer/losses.py)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * agg(entropy of the tempered distribution)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * agg(KL(pi_theta || reference)) to the loss (needs the reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss term: ``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``, ``abs``."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0..3."""
    bf16: bool = False
    """Train in bf16 (DeepSpeed bf16 mode). fp16 is refused on CPU by DeepSpeed."""
    temperature: float = 1.0
    """Logits are divided by this when computing log-probs; keep it equal to
    rollout.temperature so trainer and engine log-probs agree."""

    def validate(self) -> None:
        from hpcrl.trainer.kl import KL_ESTIMATORS
        from hpcrl.trainer.losses import LOSS_AGG_MODES

        _check_int("actor.ppo_mini_batch_size", self.ppo_mini_batch_size, 1)
        _check_int("actor.ppo_micro_batch_size", self.ppo_micro_batch_size, 1)
        _check_int("actor.ppo_epochs", self.ppo_epochs, 1)
        _check_float("actor.lr", self.lr, 0.0, lo_open=True)
        _check_float("actor.weight_decay", self.weight_decay, 0.0)
        _check_float("actor.clip_ratio", self.clip_ratio, 0.0, 1.0, lo_open=True)
        if self.clip_ratio_low is not None:
            _check_float("actor.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0, lo_open=True)
        if self.clip_ratio_high is not None:
            _check_float("actor.clip_ratio_high", self.clip_ratio_high, 0.0, lo_open=True)
        if self.clip_ratio_c is not None and (isinstance(self.clip_ratio_c, bool) or self.clip_ratio_c <= 1.0):
            raise _bad("actor.clip_ratio_c", self.clip_ratio_c, "a number > 1 or null",
                       "use e.g. 3.0 for dual-clip PPO, or null to turn it off")
        _check_choice("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_float("actor.entropy_coeff", self.entropy_coeff, 0.0)
        _check_choice("actor.use_kl_loss", self.use_kl_loss, (True, False))
        _check_float("actor.kl_loss_coef", self.kl_loss_coef, 0.0)
        _check_choice("actor.kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        _check_float("actor.grad_clip", self.grad_clip, 0.0)
        _check_int("actor.zero_stage", self.zero_stage, 0, 3)
        _check_choice("actor.bf16", self.bf16, (True, False))
        _check_float("actor.temperature", self.temperature, 0.0, lo_open=True)


@dataclass
class RolloutConfig:
    engine: str = "transformers"
    """Generation engine: ``transformers`` (CPU or GPU, any HF causal LM)."""
    n: int = 8
    """Responses per prompt (the group size GRPO normalises over)."""
    total_rollout_steps: int = 1200
    """Groups the trainer trains on in the whole run (verl: total prompts).
    The trainer makes total_rollout_steps // R local updates."""
    response_length: int = 8
    """Max new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are those of the tempered distribution)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    max_concurrent_groups: int = 2
    """Groups a rollout job generates at once (one thread each)."""
    seal_groups: int = 4
    """A shard is sealed (committed) once it holds this many groups ..."""
    seal_interval_s: float = 1.0
    """... or when its oldest group has waited this long, or when the job idles."""
    torch_threads: int = 1
    """torch intra-op threads in the rollout job."""

    def validate(self) -> None:
        _check_choice("rollout.engine", self.engine, ("transformers",))
        _check_int("rollout.n", self.n, 1)
        _check_int("rollout.total_rollout_steps", self.total_rollout_steps, 1)
        _check_int("rollout.response_length", self.response_length, 1)
        _check_float("rollout.temperature", self.temperature, 0.0, lo_open=True)
        _check_float("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("rollout.max_concurrent_groups", self.max_concurrent_groups, 1)
        _check_int("rollout.seal_groups", self.seal_groups, 1)
        _check_float("rollout.seal_interval_s", self.seal_interval_s, 0.0, lo_open=True)
        _check_int("rollout.torch_threads", self.torch_threads, 1)


@dataclass
class AsyncConfig:
    staleness_threshold: float = 0.0
    """s: per weight version the rollout fleet starts at most floor((1+s)*K*R)
    groups, counting carry-over. 0 = no stale samples."""
    require_batches: int = 1
    """Mini-batches per local update: R = ppo_mini_batch_size * require_batches groups."""
    trigger_parameter_sync_step: int = 1
    """K: local updates between two published weight versions."""
    partial_rollout: bool = False
    """Interrupt in-flight generation at a version change and resume it under the
    new weights (not implemented yet: must be false)."""
    use_rollout_log_probs: bool = True
    """PPO anchor = the engine's log-probs of the sampled tokens (true, "bypass") or
    the trainer's own log-probs at the start of the update (false)."""
    compute_prox_log_prob: bool = False
    """Decoupled PPO: also compute the trainer's log-probs at the start of each local
    update (the proximal policy) and use them as the PPO anchor, while the engine's
    log-probs stay the behaviour policy of the importance weights
    (algorithm.rollout_correction). Implied by use_rollout_log_probs=false."""
    max_staleness: Optional[int] = None
    """Hard cap on lag in versions: older groups are dropped and counted (null = off)."""

    def validate(self) -> None:
        _check_float("async_training.staleness_threshold", self.staleness_threshold, 0.0)
        _check_int("async_training.require_batches", self.require_batches, 1)
        _check_int("async_training.trigger_parameter_sync_step", self.trigger_parameter_sync_step, 1)
        if self.partial_rollout:
            raise _bad("async_training.partial_rollout", True, "false (partial rollout is not implemented yet)",
                       "set async_training.partial_rollout=false")
        _check_choice("async_training.use_rollout_log_probs", self.use_rollout_log_probs, (True, False))
        _check_choice("async_training.compute_prox_log_prob", self.compute_prox_log_prob, (True, False))
        if self.max_staleness is not None:
            _check_int("async_training.max_staleness", self.max_staleness, 0)


@dataclass
class TrainerConfig:
    checkpoint_every_updates: int = 20
    """Save model, optimizer and sample cursor together every this many local updates."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    torch_threads: int = 1
    """torch intra-op threads per trainer rank."""

    def validate(self) -> None:
        _check_int("trainer.checkpoint_every_updates", self.checkpoint_every_updates, 1)
        _check_int("trainer.keep_checkpoints", self.keep_checkpoints, 1)
        _check_int("trainer.torch_threads", self.torch_threads, 1)


@dataclass
class WeightsConfig:
    transport: str = "filesystem"
    """How weights reach rollout jobs: ``filesystem`` (safetensors folders in RUN/weights)."""
    keep_versions: int = 3
    """Newest versions always kept; older ones are deleted unless a live rollout
    job has announced it is loading them."""

    def validate(self) -> None:
        _check_choice("weights.transport", self.transport, ("filesystem",))
        _check_int("weights.keep_versions", self.keep_versions, 2)


@dataclass
class TimeoutsConfig:
    wait_samples_s: float = 600.0
    """Trainer gives up (exit 1, naming the writers and their last heartbeats)
    after waiting this long for the next group."""
    wait_weights_s: float = 600.0
    """Rollout gives up after waiting this long for a new weight version."""
    heartbeat_interval_s: float = 2.0
    """How often each job rewrites its heartbeat record."""
    heartbeat_stale_s: float = 60.0
    """A heartbeat older than this marks its job as dead (its loading
    announcements no longer protect weight versions)."""
    poll_interval_s: float = 0.05
    """Sleep between polls of the run directory."""
    wait_log_interval_s: float = 10.0
    """A job that waits for the other one logs what it waits for this often."""

    def validate(self) -> None:
        for name in ("wait_samples_s", "wait_weights_s", "heartbeat_interval_s", "heartbeat_stale_s",
                     "poll_interval_s", "wait_log_interval_s"):
            _check_float(f"timeouts.{name}", getattr(self, name), 0.0, lo_open=True)
        if self.heartbeat_stale_s <= 2 * self.heartbeat_interval_s:
            raise _bad("timeouts.heartbeat_stale_s", self.heartbeat_stale_s,
                       f"more than 2 * timeouts.heartbeat_interval_s = {2 * self.heartbeat_interval_s}")


@dataclass
class JobResources:
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
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "mem_gb", "timeout_min"):
            _check_int(f"{prefix}.{name}", getattr(self, name), 1)
        _check_int(f"{prefix}.gpus_per_node", self.gpus_per_node, 0)
        for name in ("partition", "account", "qos", "constraint"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
                raise _bad(f"{prefix}.{name}", v, "null or a single word", "quote nothing, no spaces")
        for k, v in self.sbatch_extra.items():
            if not isinstance(k, str) or not k or k.startswith("-") or any(c.isspace() for c in k):
                raise _bad(f"{prefix}.sbatch_extra", k, "option names without leading dashes, e.g. reservation")
            if not isinstance(v, (str, int, float)):
                raise _bad(f"{prefix}.sbatch_extra.{k}", v, "a string or number ('' for a flag)")
        if not all(isinstance(line, str) for line in self.setup):
            raise _bad(f"{prefix}.setup", self.setup, "a list of shell lines (strings)")


@dataclass
class ResourcesConfig:
    trainer: JobResources = field(default_factory=JobResources)
    """Resources of the trainer job (nodes * tasks_per_node DeepSpeed ranks)."""
    rollout: JobResources = field(default_factory=JobResources)
    """Resources of each rollout job."""
    rollout_jobs: int = 1
    """Number of rollout jobs (each one sample writer; a Slurm job array in sbatch/)."""
    max_restarts: int = 3
    """The launcher resubmits a job that ended before the trainer finished (crash,
    scancel, node failure) at most this many times per job; then the run fails."""

    def validate(self) -> None:
        self.trainer.validate("resources.trainer")
        self.rollout.validate("resources.rollout")
        _check_int("resources.rollout_jobs", self.rollout_jobs, 1)
        _check_int("resources.max_restarts", self.max_restarts, 0)
        if self.rollout.world_size != 1:
            raise _bad("resources.rollout.tasks_per_node", self.rollout.tasks_per_node,
                       "1 task on 1 node per rollout job", "add capacity with resources.rollout_jobs instead")


@dataclass
class LoggingConfig:
    level: str = "INFO"
    """Python logging level of both jobs."""

    def validate(self) -> None:
        _check_choice("logging.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # ---- derived quantities (the flow-control arithmetic of DESIGN.md) ----
    @property
    def groups_per_update(self) -> int:
        """R = ppo_mini_batch_size * require_batches."""
        return self.actor.ppo_mini_batch_size * self.async_training.require_batches

    @property
    def groups_per_version(self) -> int:
        """K * R: groups the trainer consumes between two weight versions."""
        return self.async_training.trigger_parameter_sync_step * self.groups_per_update

    @property
    def admission_budget(self) -> int:
        """B = floor((1 + s) * K * R): groups the fleet may start per weight version."""
        return math.floor((1.0 + self.async_training.staleness_threshold) * self.groups_per_version + 1e-9)

    @property
    def total_updates(self) -> int:
        return self.rollout.total_rollout_steps // self.groups_per_update

    @property
    def max_lag_bound(self) -> int:
        """Largest lag (versions) the admission budget allows for one writer: floor((B - 1) / (K * R))."""
        return (self.admission_budget - 1) // self.groups_per_version

    @property
    def uses_prox_log_prob(self) -> bool:
        """The trainer computes its own log-probs at the start of each update (the PPO anchor)."""
        a = self.async_training
        return a.compute_prox_log_prob or not a.use_rollout_log_probs

    @property
    def needs_reference(self) -> bool:
        """A KL term needs the frozen reference model."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    def validate(self) -> "RunConfig":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.rollout.total_rollout_steps < self.groups_per_update:
            raise _bad("rollout.total_rollout_steps", self.rollout.total_rollout_steps,
                       f"at least R = actor.ppo_mini_batch_size * async_training.require_batches = "
                       f"{self.groups_per_update}")
        est = self.algorithm.adv_estimator
        if self.rollout.n < 2 and est in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            raise _bad("rollout.n", self.rollout.n, f"at least 2 with adv_estimator={est} (a group of one has no baseline)",
                       "raise rollout.n, or use adv_estimator=gae or reinforce_plus_plus")
        rc = self.algorithm.rollout_correction
        if rc.needs_prox and not self.uses_prox_log_prob:
            name = next(k for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")
                        if getattr(rc, k) is not None)
            raise _bad(f"algorithm.rollout_correction.{name}", getattr(rc, name),
                       "null unless the trainer computes proximal log-probs (the ratio is pi_prox / engine log-probs)",
                       "set async_training.compute_prox_log_prob=true")
        world = self.resources.trainer.world_size
        if self.actor.ppo_mini_batch_size % (world * self.actor.ppo_micro_batch_size):
            raise _bad("actor.ppo_mini_batch_size", self.actor.ppo_mini_batch_size,
                       f"a multiple of trainer ranks ({world}) * actor.ppo_micro_batch_size "
                       f"({self.actor.ppo_micro_batch_size})", "each rank takes an equal share of a mini-batch")
        if abs(self.actor.temperature - self.rollout.temperature) > 1e-9:
            raise _bad("actor.temperature", self.actor.temperature,
                       f"equal to rollout.temperature={self.rollout.temperature}",
                       "set both to the same value so the trainer's log-probs match the engine's")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# Building a RunConfig from YAML + overrides, strictly.

def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise _bad(prefix or "<root>", data, "a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise _bad(key, data[unknown[0]], "known keys: " + ", ".join(sorted(names)), "remove or rename the key")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        else:
            kwargs[name] = _coerce(key, hint, value)
    return cls(**kwargs)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, args[0], value)
    if hint in (dict, list) or typing.get_origin(hint) in (dict, list):
        base = typing.get_origin(hint) or hint
        if not isinstance(value, base):
            raise _bad(key, value, f"a {'mapping' if base is dict else 'list'}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise _bad(key, value, f"a value of type {hint.__name__}")
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. async_training.staleness_threshold=0.5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    return key, yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: Optional[os.PathLike | str] = None, overrides: Optional[list[str]] = None) -> RunConfig:
    """Read YAML (or start from defaults), apply ``key=value`` overrides, validate."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass one of configs/*.yaml")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping of sections")
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    return _build(RunConfig, tree, "").validate()


def config_from_dict(tree: dict) -> RunConfig:
    return _build(RunConfig, tree, "").validate()


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
