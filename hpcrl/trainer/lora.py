"""The trainer's LoRA (``actor.lora_rank``): the policy as a peft model, its adapter as a weight version, and
the base model (adapter off) as the KL reference.

What changes against full fine-tuning, and nothing else:

- **model**: the policy loaded from ``model.path`` is wrapped by peft's ``get_peft_model`` with a LoraConfig of
  ``actor.lora_rank``, ``lora_alpha``, ``lora_target_modules`` and ``lora_dropout`` (seeded by ``model.seed``:
  lora_A random, lora_B zero, so version 0 is the base model). Every base weight is frozen; only the adapter
  (and the value head with ``gae``) is given to the optimizer, so DeepSpeed keeps Adam state for the adapter
  alone.
- **reference**: :class:`AdapterOff` runs the same module with peft's ``disable_adapter()``: the base model, no
  second copy in memory.
- **checkpoints**: DeepSpeed saves without frozen parameters (``exclude_frozen_parameters``) and loads
  non-strictly: a checkpoint holds the adapter, the value head and the optimizer; the base comes from
  ``model.path``, whose hash every job checks (``hpcrl/weights/adapter.py``).
- **publish**: :func:`adapter_state_dict` is the adapter under peft's saved names (``get_peft_model_state_dict``;
  under ZeRO-3 the adapter's parameters alone are gathered, one collective), published with peft's
  ``adapter_config.json`` (:func:`adapter_config_json`) as an adapter version.
"""
from __future__ import annotations

import json

import torch
from torch import nn


def lora_config(actor):
    """peft's LoraConfig of ``actor.lora_*`` (an ActorConfig)."""
    from peft import LoraConfig

    targets = actor.lora_target_modules
    return LoraConfig(r=actor.lora_rank, lora_alpha=actor.lora_alpha, lora_dropout=actor.lora_dropout,
                      target_modules=targets if isinstance(targets, str) else list(targets), bias="none",
                      task_type="CAUSAL_LM")


def wrap_policy(policy: nn.Module, actor, seed: int) -> nn.Module:
    """``policy`` with a fresh LoRA adapter (seeded), every base weight frozen (module docstring)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(policy, lora_config(actor))


def peft_model(module: nn.Module):
    """The peft model inside the trainer's module (a DeepSpeed engine's ``module``, a PolicyWithValueHead)."""
    from peft import PeftModel

    inner = getattr(module, "module", module)
    inner = getattr(inner, "policy", inner)
    assert isinstance(inner, PeftModel), f"LoRA run, but the policy is a {type(inner).__name__}"
    return inner


def adapter_config_json(module: nn.Module, base_path: str) -> str:
    """peft's ``adapter_config.json`` of the trainer's adapter, naming ``base_path`` as its base."""
    cfg = peft_model(module).peft_config["default"]
    d = cfg.to_dict()
    d["base_model_name_or_path"] = str(base_path)
    d["target_modules"] = sorted(d["target_modules"]) if isinstance(d["target_modules"], (set, list)) else \
        d["target_modules"]
    return json.dumps(d, indent=2, sort_keys=True, default=sorted)


def adapter_state_dict(module: nn.Module, zero3: bool, rank: int) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names, on CPU, on rank 0 (``{}`` on the others). Under ZeRO-3
    every rank must call it (one gather of the adapter's parameters)."""
    from peft import get_peft_model_state_dict

    model = peft_model(module)
    if not zero3:
        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}
    import deepspeed

    params = [p for n, p in model.named_parameters() if "lora_" in n]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if rank != 0:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


class AdapterOff(nn.Module):
    """The KL reference of a LoRA run: the trainer's own model with the adapter switched off (the base model).
    Called like the policy (:class:`hpcrl.trainer.models.PolicyWithValueHead`); no gradient flows (the caller runs
    it under ``no_grad``). Not a submodule of anything: it holds the engine's module by reference."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["_module"] = module  # not registered: its parameters are the policy's

    def forward(self, pack, **kwargs):
        with peft_model(self._module).disable_adapter():
            logp, more, _ = self._module(pack, **kwargs)
        return logp, more, None
