"""LoRA's config rules: the ``actor.lora_*`` fields' ranges and what LoRA cannot go with.

With ``actor.lora_rank`` set, the trainer trains a peft LoRA adapter on the frozen base model
(``model.path``), every weight version is that adapter alone, and the engines apply it to the same base
(``hpcrl/trainer/lora.py``, ``hpcrl/weights/adapter.py``). The rules that need the model or an engine
(a target module the model lacks, an engine build that cannot serve adapters) are checked at launch
(``hpcrl/launcher/lora_check.py``); the ones here need the config only. Each error is one line naming the
key, what is allowed and the fix.
"""
from __future__ import annotations

from hpcrl.config.checks import check_float, fail, reported

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``actor.lora_target_modules``' default: the attention and MLP projections of a Llama/Qwen-style decoder layer."""
ALL_LINEAR = "all-linear"
"""peft's name for every linear layer of the model but the output layer (verl's ``target_modules`` default)."""
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (the same in 0.25.0 and 0.32.0): an engine serves ranks up to the
smallest of these that is >= ``actor.lora_rank``."""


def vllm_max_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` a vLLM engine is started with to serve adapters of ``rank``; ValueError past 512."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}, got {rank}")


def validate_lora_fields(actor) -> None:
    """The ranges of ``actor.lora_rank``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules`` (an ActorConfig);
    each problem reported into the pass (:func:`hpcrl.config.checks.collecting`)."""
    rank = actor.lora_rank
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
        fail("actor.lora_rank", rank, "null (full fine-tuning: every weight is trained) or an integer >= 1 (a LoRA "
             "adapter of that rank is trained on the frozen model)",
             "e.g. actor.lora_rank=8, or leave it out for full fine-tuning (verl's lora_rank=0 means that)")
    check_float("actor.lora_alpha", actor.lora_alpha, 0.0, lo_open=True)
    p = actor.lora_dropout
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        fail("actor.lora_dropout", p, "a number >= 0 and < 1 (the probability of dropping an input of the adapter)")
    targets = actor.lora_target_modules
    example = f"e.g. [{', '.join(DEFAULT_TARGET_MODULES)}]"
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            fail("actor.lora_target_modules", targets, f"a list of module names or {ALL_LINEAR!r}", example)
    elif not targets or not all(isinstance(t, str) and t.strip() for t in targets):
        fail("actor.lora_target_modules", targets, f"a non-empty list of module names or {ALL_LINEAR!r}", example)


def check_lora_combination(cfg) -> None:
    """Report each option that LoRA cannot go with (``cfg``: a RunConfig); skipped where the rank is reported wrong."""
    rank = cfg.actor.lora_rank
    if rank is None or reported("actor.lora_rank"):
        return
    if cfg.trainer.simulated or cfg.rollout.engine == "simulated":
        key = "trainer.simulated" if cfg.trainer.simulated else "rollout.engine"
        fail(key, True if cfg.trainer.simulated else "simulated",
             "false / a real engine with actor.lora_rank set (the simulated parts model full-weight training and "
             "publish the tiny model's full weights)", "leave actor.lora_rank out of a simulated run")
    engines = {cfg.rollout.engine} | ({cfg.eval.engine} if cfg.eval.enabled and cfg.eval.engine else set())
    if "vllm" in engines and rank > VLLM_MAX_LORA_RANKS[-1]:
        fail("actor.lora_rank", rank, f"at most {VLLM_MAX_LORA_RANKS[-1]} with the vllm engine (vLLM's largest "
             "max_lora_rank)", "lower actor.lora_rank, or rollout.engine=transformers")
