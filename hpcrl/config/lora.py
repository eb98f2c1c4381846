"""LoRA's config rules: the ``actor.lora_*`` fields' ranges and what LoRA cannot go with.

With ``actor.lora_rank`` set, the trainer trains a peft LoRA adapter on the frozen base model
(``model.path``), every weight version is that adapter alone, and the engines apply it to the same base
(``hpcrl/trainer/lora.py``, ``hpcrl/weights/adapter.py``). The rules that need the model or an engine
(a target module the model lacks, an engine build that cannot serve adapters) are checked at launch
(``hpcrl/launcher/lora_check.py``); the ones here need the config only. Each error is one line naming the
key, what is allowed and the fix.
"""
from __future__ import annotations

from hpcrl.config import registries
from hpcrl.config.checks import check_float, fail, reported

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""``actor.lora_target_modules``' default: the attention and MLP projections of a Llama/Qwen-style decoder layer."""
ALL_LINEAR = "all-linear"
"""peft's name for every linear layer of the model but the output layer (verl's ``target_modules`` default)."""


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
    engine = registries.engine_spec(cfg.rollout.engine)
    if cfg.trainer.simulated or (engine is not None and engine.simulated):
        key = "trainer.simulated" if cfg.trainer.simulated else "rollout.engine"
        fail(key, True if cfg.trainer.simulated else cfg.rollout.engine,
             "false / a real engine with actor.lora_rank set (the simulated parts model full-weight training and "
             "publish the tiny model's full weights)", "leave actor.lora_rank out of a simulated run")
    keys = ["rollout.engine"] + (["eval.engine"] if cfg.eval.enabled and cfg.eval.engine else [])
    for key in keys:
        name = cfg.rollout.engine if key == "rollout.engine" else cfg.eval.engine
        spec = registries.engine_spec(name)
        if spec is not None and spec.max_lora_rank is not None and rank > spec.max_lora_rank:
            fail("actor.lora_rank", rank, f"at most {spec.max_lora_rank} with {key}={name} (the largest adapter "
                 "rank it serves)", "lower actor.lora_rank, or an engine that serves it (" + ", ".join(
                     n for n, s in registries.ENGINES.items() if s.max_lora_rank is None and not s.simulated) + ")")
            break
