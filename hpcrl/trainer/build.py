"""The policy (and value head) under DeepSpeed, and the frozen reference under the same memory rules.

What ``actor.*`` turns into, in one place:

- **dtype**: the model is loaded in its training dtype (bf16 when ``actor.bf16`` is on; DeepSpeed keeps the
  fp32 master weights in the optimizer), never first in fp32 (7B parameters are 28 GB in fp32 per rank);
- **attention**: ``actor.attn_implementation`` (``auto``: ``flash_attention_2`` on a GPU with flash-attn
  installed, else ``sdpa``), which also decides how micro-batches are packed (:mod:`hpcrl.trainer.forward`);
- **activation checkpointing** (``actor.gradient_checkpointing``): transformers' per-layer checkpointing,
  non-reentrant (it works with LoRA and ZeRO-3);
- **ZeRO** (``actor.zero_stage``) with ``offload_param`` / ``offload_optimizer``; under ZeRO-3 the model is
  partitioned as it loads (transformers' DeepSpeed integration: no rank ever holds all of it), and the
  reference is a ZeRO-3 engine of its own (partitioned, offloaded like the policy, no optimizer);
- **sequence parallelism** (``actor.ulysses_sequence_parallel_size``): DeepSpeed's Ulysses registered for the
  attention kernel, its parallel state given to ``deepspeed.initialize`` (:mod:`hpcrl.trainer.sequence_parallel`);
- **gradient accumulation** is set per micro-batch by the update (:mod:`hpcrl.trainer.update`: the number of
  micro-batches of a mini-batch varies with a token budget), so the DeepSpeed config says 1 and never scales.

The optimizer is torch's AdamW (DeepSpeed's fused and CPU Adam are JIT-compiled ops; with optimizer offload
the step then runs on the CPU in torch).
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from hpcrl.trainer.forward import Layout
from hpcrl.trainer.logprobs import chunk_rows

log = logging.getLogger("hpcrl.trainer")


def attention_kernel(actor, cuda: bool) -> str:
    """``actor.attn_implementation`` with ``auto`` resolved (module docstring)."""
    if actor.attn_implementation != "auto":
        return actor.attn_implementation
    return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") is not None else "sdpa"


def training_dtype(actor, cuda: bool) -> torch.dtype:
    return torch.bfloat16 if actor.bf16_on(cuda) else torch.float32


def ds_config(actor, cuda: bool) -> dict:
    """The DeepSpeed config of ``actor.*`` (module docstring)."""
    zero: dict = {"stage": actor.zero_stage}
    if actor.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if actor.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_micro_batch_size_per_gpu": 1,  # a "micro step" is one backward of a micro-batch, whatever its rows
        "gradient_accumulation_steps": 1,     # the update sets the boundary itself (module docstring)
        "gradient_clipping": actor.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a plain torch AdamW: no JIT-compiled fused_adam on CPU
        "zero_force_ds_cpu_optimizer": False,   # ... also with optimizer offload (the step runs in torch on the CPU)
        "bf16": {"enabled": actor.bf16_on(cuda)},
        "steps_per_print": 10**9,
    }


def load_causal_lm(path, dtype: torch.dtype, attn: str, zero3_config: dict | None):
    """The model folder as a causal LM in ``dtype`` with ``attn``; with a ZeRO-3 config, partitioned across the
    ranks while it loads (transformers' ``HfDeepSpeedConfig``: kept alive for the load only)."""
    from transformers import AutoModelForCausalLM

    keep = None
    if zero3_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(zero3_config)  # noqa: F841 (transformers reads it through a weak reference)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    del keep
    return model


def checkpoint_layers(model) -> None:
    """Activation checkpointing of every layer (non-reentrant: LoRA's frozen inputs need no grad of their own)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def layout_of(actor, model_config, attn: str, world: int) -> Layout:
    """How micro-batches reach this model (:class:`hpcrl.trainer.forward.Layout`) on one of ``world`` ranks."""
    pad_id = model_config.pad_token_id if model_config.pad_token_id is not None else 0
    return Layout(actor.use_remove_padding, attn, pad_id, chunk_rows(actor.logprob_chunk_mib, model_config.vocab_size),
                  actor.ulysses_sequence_parallel_size, same_forwards=actor.zero_stage == 3 and world > 1)


def frozen_engine(module: torch.nn.Module, actor, cuda: bool) -> torch.nn.Module:
    """A frozen module for no-grad forwards under the policy's memory rules: under ZeRO-3 a DeepSpeed engine of its
    own (partitioned, offloaded like the policy, no optimizer), its module returned; else the module itself."""
    module.requires_grad_(False)
    module.eval()
    if actor.zero_stage != 3:
        return module
    import deepspeed

    config = ds_config(actor, cuda)
    config["zero_optimization"].pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    return engine.module
