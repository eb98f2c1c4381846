"""The run config: its sections together, the flow-control arithmetic, and strict loading.

A config is a YAML file (``configs/*.yaml``) plus dotted command-line overrides
(``async_training.staleness_threshold=0.5``). Unknown keys are errors, every
value is range-checked by :meth:`RunConfig.validate`, and the resolved config is
frozen into the run directory as ``config.yaml`` at launch; both jobs read that
frozen copy, never the user's file.

Every default lives in the section dataclasses, once (:mod:`hpcrl.config.sections`,
:mod:`hpcrl.config.algorithm`, :mod:`hpcrl.config.resources`). The async knobs
keep verl's names (``fully_async_policy``) so users can move their settings across.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from hpcrl.config import registries
from hpcrl.config.actor import ActorConfig
from hpcrl.config.algorithm import AlgorithmConfig, CriticConfig
from hpcrl.config.checks import ConfigError, bad, collecting, fail, report, reported
from hpcrl.config.combinations import check_algorithm_combinations
from hpcrl.config.dapo import check_dapo_combination
from hpcrl.config.evaluation import EvalConfig
from hpcrl.config.knobs import Knobs
from hpcrl.config.names import BUILTIN_MODELS
from hpcrl.config.lora import check_lora_combination
from hpcrl.config.resources import ResourcesConfig
from hpcrl.config.reward_model import RewardModelConfig, check_reward_model_combination
from hpcrl.config.runtime import LoggingConfig, TimeoutsConfig
from hpcrl.config.simulated import SimulatedConfig, check_simulated_combination
from hpcrl.config.sections import (AgentConfig, AsyncConfig, DataConfig, ModelConfig, RewardConfig,
                                   RolloutConfig, TrainerConfig, WeightsConfig)
from hpcrl.config.verl import Schema, translate, unknown_key_message

log = logging.getLogger(__name__)


@dataclass
class RunConfig:
    """The whole run config: every section, and the flow-control quantities derived from them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)

    # ---- derived quantities (the flow-control arithmetic, written once in config/knobs.py) ----
    @property
    def knobs(self) -> Knobs:
        """The async knobs and what follows from them (R, K*R, the admission budget B, the lag bound)."""
        a = self.async_training
        parts = [p for p, on in (("engine", registries.simulated_engine(self.rollout.engine)),
                                 ("trainer", self.trainer.simulated)) if on]
        return Knobs(staleness_threshold=a.staleness_threshold,
                     trigger_parameter_sync_step=a.trigger_parameter_sync_step,
                     ppo_mini_batch_size=self.actor.ppo_mini_batch_size, require_batches=a.require_batches,
                     partial_rollout=a.partial_rollout, max_staleness=a.max_staleness, n=self.rollout.n,
                     rollout_jobs=self.resources.rollout_jobs, max_concurrent_groups=self.rollout.max_concurrent_groups,
                     budget_share=self.rollout.budget_share, max_num_seqs=self.rollout.max_num_seqs,
                     total_rollout_steps=self.rollout.total_rollout_steps, simulated=" and ".join(parts),
                     time_scale=self.simulated.time_scale if parts else 1.0)

    @property
    def groups_per_update(self) -> int:
        """R = ppo_mini_batch_size * require_batches."""
        return self.knobs.groups_per_update

    @property
    def groups_per_version(self) -> int:
        """K * R: groups the trainer consumes between two weight versions."""
        return self.knobs.groups_per_version

    @property
    def admission_budget(self) -> int:
        """B = floor((1 + s) * K * R): groups the fleet may start per weight version."""
        return self.knobs.admission_budget

    @property
    def total_updates(self) -> int:
        """Trainer updates in the run: total_rollout_steps // R."""
        return self.knobs.total_updates

    @property
    def max_lag_bound(self) -> int:
        """Largest lag (versions) the admission budget allows for one writer: floor((B - 1) / (K * R))."""
        return self.knobs.max_lag_bound

    @property
    def uses_prox_log_prob(self) -> bool:
        """The trainer computes its own log-probs at the start of each update (the PPO anchor)."""
        a = self.async_training
        return a.compute_prox_log_prob or not a.use_rollout_log_probs

    @property
    def lora(self) -> bool:
        """The trainer trains a LoRA adapter and every weight version is one (``actor.lora_rank`` set)."""
        return self.actor.lora_rank is not None

    @property
    def needs_reference(self) -> bool:
        """A KL term needs the frozen reference model."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    def validate(self) -> "RunConfig":
        """Check every section, then the rules that span sections; return self. Every problem is reported at
        once (:func:`hpcrl.config.checks.collecting`); a rule that reads a value already reported wrong is
        skipped."""
        with collecting() as problems:
            for f in dataclasses.fields(self):
                getattr(self, f.name).validate()
            self._check_spans()
            check_algorithm_combinations(self)
            check_dapo_combination(self)
            check_simulated_combination(self)
            check_lora_combination(self)
            check_reward_model_combination(self)
            self._check_eval()
            if problems.errors:
                problems.suggest_defaults(Schema.of(RunConfig).defaults)
        return self

    def _check_spans(self) -> None:
        """The rules between the trainer's batch, the rollout jobs' devices and the weights' transport."""
        actor, ro, world = self.actor, self.rollout, self.resources.trainer.world_size
        if self.rollout.total_rollout_steps < self.groups_per_update and not reported(
                "actor.ppo_mini_batch_size", "async_training.require_batches"):
            fail("rollout.total_rollout_steps", self.rollout.total_rollout_steps,
                 f"at least R = actor.ppo_mini_batch_size * async_training.require_batches = {self.groups_per_update}")
        sp = actor.ulysses_sequence_parallel_size
        if world % sp and not reported("actor.ulysses_sequence_parallel_size", "resources.trainer."):
            fail("actor.ulysses_sequence_parallel_size", sp, f"a divisor of the trainer's ranks ({world})",
                 "each sequence-parallel group is sp whole ranks")
        dp = max(1, world // sp)  # data-parallel ranks: each sequence-parallel group counts once
        sizes = ("actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "resources.trainer.", "actor.ulysses")
        if not reported(*sizes) and not actor.use_dynamic_bsz and actor.ppo_mini_batch_size % (
                dp * actor.ppo_micro_batch_size):
            fail("actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
                 f"a multiple of data-parallel trainer ranks ({dp}) * actor.ppo_micro_batch_size "
                 f"({actor.ppo_micro_batch_size})", "each rank takes an equal share of a mini-batch (or set "
                 "actor.use_dynamic_bsz=true: micro-batches by tokens, shares balanced by tokens)")
        if sp > 1 and (not actor.use_remove_padding or actor.attn_implementation == "eager"):
            fail("actor.ulysses_sequence_parallel_size", sp, "1 with actor.use_remove_padding=false or "
                 "actor.attn_implementation=eager (Ulysses splits one packed sequence and drops attention masks)",
                 "set actor.use_remove_padding=true and actor.attn_implementation=auto")
        gpus = self.resources.rollout.gpus_per_node
        if ro.device == "cuda" and gpus == 0:
            fail("rollout.device", ro.device, "cpu or auto while resources.rollout.gpus_per_node is 0",
                 "set resources.rollout.gpus_per_node to the GPUs each rollout job should get")
        spec = registries.engine_spec(ro.engine)
        parallel = spec is not None and spec.parallel
        if parallel and gpus and ro.tensor_parallel_size * ro.data_parallel_size > gpus:
            fail("rollout.tensor_parallel_size", ro.tensor_parallel_size,
                 f"tensor_parallel_size * data_parallel_size ({ro.tensor_parallel_size} * {ro.data_parallel_size}) "
                 f"<= resources.rollout.gpus_per_node ({gpus})", "lower the parallel sizes or give each rollout job "
                 "more GPUs")
        if self.weights.broadcast_backend == "nccl" and 0 in (self.resources.trainer.gpus_per_node, gpus):
            fail("weights.broadcast_backend", "nccl", "auto or gloo on a run without GPUs (nccl needs a GPU on "
                 f"the trainer and on every rollout job; resources.trainer.gpus_per_node="
                 f"{self.resources.trainer.gpus_per_node}, resources.rollout.gpus_per_node={gpus})",
                 "set weights.broadcast_backend=auto (picks gloo here), or give both jobs GPUs")
        if abs(actor.temperature - ro.temperature) > 1e-9 and not reported("actor.temperature", "rollout.temperature"):
            fail("actor.temperature", actor.temperature, f"equal to rollout.temperature={ro.temperature}",
                 "set both to the same value so the trainer's log-probs match the engine's")

    def _check_eval(self) -> None:
        """The evaluation job needs held-out prompts, and GPUs where its engine runs on cuda."""
        if not self.eval.enabled:
            return
        if not self.data.val_files:
            fail("data.val_files", self.data.val_files, f"held-out prompt files with eval.every_versions="
                 f"{self.eval.every_versions}", "set data.val_files (e.g. builtin:toy_heldout or a .parquet), "
                 "or eval.every_versions=0 for no evaluation")
        if self.rollout.device == "cuda" and self.resources.eval.gpus_per_node == 0:
            fail("resources.eval.gpus_per_node", 0, "at least 1 with rollout.device=cuda (the evaluation "
                 "engine uses rollout's device)", "set resources.eval.gpus_per_node, or rollout.device=auto")

    @property
    def is_simulated(self) -> bool:
        """The engine (and maybe the trainer) only sleeps: every log line and the report say so."""
        return registries.simulated_engine(self.rollout.engine) or self.trainer.simulated

    @property
    def is_sizing_probe(self) -> bool:
        """The simulated engine feeds the real trainer on a real model (config/simulated.py)."""
        return registries.simulated_engine(self.rollout.engine) and not self.trainer.simulated \
            and self.model.path not in BUILTIN_MODELS

    def to_dict(self) -> dict:
        """Plain dict of every field (what ``config.yaml`` holds)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# Building a RunConfig from YAML + overrides, strictly.

def _build(cls: type, data: Any, prefix: str) -> Any:
    """``cls`` from a parsed tree; a key that is unknown or of the wrong type is reported (the field keeps its
    default, so the checks after it still run on a well-typed config)."""
    if not isinstance(data, dict):
        fail(prefix or "<root>", data, "a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in sorted(set(data) - names):  # a frozen config written by another hpcrl (load_config translated the rest)
        report(ConfigError(unknown_key_message(f"{prefix}.{k}" if prefix else k, data[k], Schema.of(RunConfig))))
    kwargs = {}
    for name, value in data.items():
        if name not in names:
            continue
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
            continue
        try:
            kwargs[name] = _coerce(key, hint, value)
        except ConfigError as e:
            report(e)
    return cls(**kwargs)


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        if len(args) == 1:
            return _coerce(key, args[0], value)
        for arg in args:  # Union[A, B]: the first type the value fits
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                pass
        raise bad(key, value, " or ".join(_kind(a) for a in args))
    if hint in (dict, list) or typing.get_origin(hint) in (dict, list):
        base = typing.get_origin(hint) or hint
        if not isinstance(value, base):
            raise bad(key, value, f"a {'mapping' if base is dict else 'list'}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string; everyone writes lr: 1e-6
    if hint in (int, float, str, bool) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise bad(key, value, f"a value of type {hint.__name__}")
    return value


def _kind(hint: Any) -> str:
    """``a list``, ``a mapping``, ``a value of type str``: what a value of type ``hint`` is, for a message."""
    base = typing.get_origin(hint) or hint
    return {list: "a list", dict: "a mapping"}.get(base, f"a value of type {getattr(base, '__name__', base)}")


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` -> (dotted key, YAML-parsed value). Hydra's ``+key=value`` and ``++key=value`` (add a
    key verl's defaults lack / force it) are read as ``key=value``: hpcrl has no defaults file to add to."""
    if text.strip().startswith("~"):
        raise ConfigError(f"override {text!r}: Hydra's ~key (delete a key) has nothing to delete here; "
                          "leave the key out, or set it to null")
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. async_training.staleness_threshold=0.5")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    return key, yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: Optional[os.PathLike | str] = None, overrides: Optional[list[str]] = None,
                notes: Optional[list[str]] = None) -> RunConfig:
    """Read YAML (or start from defaults), apply ``key=value`` overrides, validate. verl's keys are read
    through :data:`hpcrl.config.verl_keys.VERL_KEYS` (:mod:`hpcrl.config.verl`); the lines saying how go to
    ``notes`` (else to the log), once per key."""
    with collecting():  # malformed overrides, unknown keys, wrong types and values out of range: all in one pass
        pairs = []
        for text in overrides or []:
            try:
                pairs.append(parse_override(text))
            except ConfigError as e:
                report(e)
        tree, lines = translate(_read_yaml(path), pairs, RunConfig)
        if notes is None:
            for line in lines:
                log.info("%s", line)
        else:
            notes.extend(lines)
        return _build(RunConfig, tree, "").validate()


def _read_yaml(path: Optional[os.PathLike | str]) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass one of configs/*.yaml")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of sections")
    return tree


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line, placed in the file: ``line 5, column 15: mapping values are not allowed here
    (while parsing a block mapping from line 3)``."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    since = f" ({context} from line {cmark.line + 1})" if context and cmark is not None else ""
    return (f"{where}{problem}{since}; fix: check the indentation and the ': ' after each key there (a value with "
            "': ' or '#' in it needs quotes)")


def given_keys(path: Optional[os.PathLike | str], overrides: Optional[list[str]] = None) -> set[str]:
    """The hpcrl keys (dotted) that a config file and overrides set explicitly, verl's keys read as hpcrl's."""
    tree, _ = translate(_read_yaml(path), [parse_override(text) for text in overrides or []], RunConfig)
    out: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            walk(v, key) if isinstance(v, dict) and not key.endswith(("sbatch_extra", "kwargs")) else out.add(key)
    walk(tree, "")
    return out


def config_from_dict(tree: dict) -> RunConfig:
    """Build and validate a RunConfig from a parsed YAML tree (unknown keys fail)."""
    with collecting():
        return _build(RunConfig, tree, "").validate()


def dump_config(cfg: RunConfig) -> str:
    """The YAML text of a config (frozen into ``RUN/config.yaml``)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
