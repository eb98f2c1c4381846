"""LoRA adapter versions in an engine (``actor.lora_rank``): the checks every engine makes before it applies one,
and the transformers engine's way of applying it (peft on the engine's own model). The vLLM engine serves
adapters with vLLM's own LoRA support (``vllm_engine.py``).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from hpcrl.weights.base import WeightVersion


def check_kind(version: WeightVersion, lora_rank: int, engine: str) -> None:
    """ValueError (one line) if ``version`` is not what the engine serves: an adapter for an engine started for full
    weights, full weights for one serving adapters, or an adapter of a rank above ``lora_rank``."""
    if version.adapter is None and lora_rank:
        raise ValueError(f"weight version {version.version} holds full weights, but the {engine} engine serves LoRA "
                         "adapters (actor.lora_rank is set): a run's versions are all one kind")
    if version.adapter is not None:
        if not lora_rank:
            raise ValueError(f"weight version {version.version} is a LoRA adapter, but the {engine} engine was started "
                             "for full weights (actor.lora_rank is null in its config)")
        if version.adapter["r"] > lora_rank:
            raise ValueError(f"weight version {version.version} is a rank-{version.adapter['r']} adapter; the "
                             f"{engine} engine serves ranks up to {lora_rank}")


class PeftAdapter:
    """The transformers engine's adapter: peft's LoRA layers injected into the engine's model (in place, so the
    engine's own forward applies them), created from the first adapter version's config; each version's tensors
    are then copied into them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.peft = None  # the PeftModel around ``model``, once the first adapter arrived
        self.config: Optional[dict] = None

    def load(self, version: WeightVersion) -> None:
        """Copy the adapter's tensors into the LoRA layers (created at the first version); ValueError if the
        version's adapter has another shape (rank, targets) or does not fill every LoRA weight."""
        from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

        config = {k: v for k, v in version.adapter.items() if k not in ("base_model_name_or_path", "revision")}
        if self.peft is None:
            self.peft = get_peft_model(self.model, PeftConfig.from_peft_type(**config))
            self.peft.eval()
            self.config = config
        elif _shape(config) != _shape(self.config):
            raise ValueError(f"weight version {version.version}: adapter {_shape(config)} differs from the engine's "
                             f"{_shape(self.config)}")
        wanted = {n for n, _ in self.peft.named_parameters() if "lora_" in n}
        result = set_peft_model_state_dict(self.peft, version.tensors)  # copies (device, dtype)
        missing = sorted(set(result.missing_keys) & wanted)
        if missing or result.unexpected_keys:
            raise ValueError(f"weight version {version.version}: the adapter does not fit the model (missing "
                             f"{missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]})")


def _shape(config: dict) -> tuple:
    targets = config.get("target_modules")
    return config.get("r"), config.get("lora_alpha"), sorted(targets) if isinstance(targets, list) else targets
