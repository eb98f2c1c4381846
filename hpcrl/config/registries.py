"""The registries: each name a config may choose for a pluggable part -> where its implementation lives.

An entry is ``"package.module:attribute"``. The config checks a value against the registry itself before
anything is submitted (``check_choice(key, value, registries.ENGINES)``), and the job that needs the
implementation imports it by that path only when the name is chosen (:func:`resolve`; vLLM is an optional
dependency). So the config knows the names and nothing of the jobs (``tests/test_layers.py``: it imports
nothing else of hpcrl), and adding an engine, an agent loop, a tool parser, a weight backend, a reward rule or a
policy loss is one file (or function) and one line here. ``tests/test_rules_once.py`` fails on a list of these
names anywhere else in the package or the benches, and on an entry whose module or attribute does not exist.
"""
from __future__ import annotations

import importlib
from typing import Any

from hpcrl.config.names import BY_DATA_SOURCE, SIMULATED_ENGINE, SINGLE_TURN, TOOL_AGENT


def resolve(path: str) -> Any:
    """The object a registry entry ``"package.module:attribute"`` names, its module imported now. Called by the
    registries' users (the jobs, when a name is chosen), never by the config's checks."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


ENGINES: dict[str, str] = {
    "transformers": "hpcrl.rollout.transformers_engine:TransformersEngine",
    "vllm": "hpcrl.rollout.vllm_engine:VLLMEngine",
    SIMULATED_ENGINE: "hpcrl.rollout.simulated_engine:SimulatedEngine",
}
"""Registry of ``rollout.engine`` and ``eval.engine``: the engine class, built as ``cls(EngineOptions)``
(hpcrl/rollout/engine.py is the interface, one file per backend; hpcrl/rollout/engines.py starts one)."""

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

_BROADCAST = ("hpcrl.weights.broadcast:BroadcastPublisher", "hpcrl.weights.broadcast:BroadcastSubscriber")
WEIGHT_TRANSPORTS: dict[str, tuple[str, str]] = {
    "auto": _BROADCAST,
    "broadcast": _BROADCAST,
    "filesystem": ("hpcrl.weights.filesystem:FilesystemPublisher", "hpcrl.weights.filesystem:FilesystemSubscriber"),
}
"""Registry of ``weights.transport``: (publisher class, subscriber class) behind hpcrl/weights/base.py, built by
hpcrl/weights/registry.py. ``broadcast`` and ``auto`` share a backend: ``broadcast`` fails where the broadcast
cannot form, ``auto`` falls back to files."""

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


_LOSSES = "hpcrl.trainer.policy_losses"
POLICY_LOSS_MODES: dict[str, str] = {
    "vanilla": f"{_LOSSES}:vanilla_loss", "gspo": f"{_LOSSES}:gspo_loss", "cispo": f"{_LOSSES}:cispo_loss",
    "gpg": f"{_LOSSES}:gpg_loss", "clip_cov": f"{_LOSSES}:clip_cov_loss", "kl_cov": f"{_LOSSES}:kl_cov_loss",
    "geo_mean": f"{_LOSSES}:geo_mean_loss", "dppo_tv": f"{_LOSSES}:dppo_tv_loss", "dppo_kl": f"{_LOSSES}:dppo_kl_loss",
    "sapo": f"{_LOSSES}:sapo_loss", "dro": f"{_LOSSES}:dro_loss",
}
"""Registry of ``actor.policy_loss.loss_mode``: the loss, ``fn(logp, logp_old, advantages, mask, LossParams,
weights, agg) -> (loss, stats)`` (hpcrl/trainer/policy_losses.py)."""
