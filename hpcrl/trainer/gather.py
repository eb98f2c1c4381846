"""The policy's full weights on trainer rank 0 for a publish, from a ZeRO-3 engine: one gather per layer.

Under ZeRO-3 every rank holds a slice of each parameter. DeepSpeed's own
``_zero3_consolidated_16bit_state_dict`` gathers module by module (each ``Linear`` of each layer is
its own all-gather). Here the parameters are grouped by *layer* (each element of a ``ModuleList``:
a decoder layer, with its attention, MLP and norms) plus one group for what lies outside the layers
(embeddings, final norm, head), and each group is gathered at once (``GatheredParameters`` on the
list: one coalesced all-gather), so a version costs ``layers + 1`` collectives instead of one per
module. Rank 0 copies each gathered group to CPU before it is released, so no GPU holds more than one
layer unsharded on top of its slice. Measured on CPU (gloo, 2 ranks, ``bench/bench_zero3_gather.py``)
it takes the same time as DeepSpeed's (bytes dominate there); the fewer collectives are for NCCL.
Every rank calls this in the same order (it is a collective); ranks > 0 get ``{}``.
"""
from __future__ import annotations

import torch
from torch import nn


def layer_groups(module: nn.Module, prefix: str = "") -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """``(layer prefix, [(name, parameter), ...])`` for the parameters whose name starts with
    ``prefix``, grouped by the outermost ``ModuleList`` element they belong to; ``""`` is the group of
    the rest. In ``named_parameters`` order (the same on every rank), tied parameters once."""
    layers = [f"{name}.{i}." for name, m in module.named_modules() if isinstance(m, nn.ModuleList)
              for i in range(len(m))]
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        if not name.startswith(prefix):
            continue
        owners = [lp for lp in layers if name.startswith(lp)]
        key = min(owners, key=len) if owners else ""  # the outermost layer (a MoE layer, not its expert)
        groups.setdefault(key, []).append((name, p))
    return list(groups.items())


def zero3_state_dict(module: nn.Module, rank: int, prefix: str = "") -> tuple[dict[str, torch.Tensor], int]:
    """Rank 0: the full state dict (on CPU) of the entries under ``prefix``, tied names sharing one
    tensor, persistent buffers included; other ranks: ``{}``. Also the number of gathers made."""
    import deepspeed

    gathered: dict[int, torch.Tensor] = {}
    groups = layer_groups(module, prefix)
    for _, params in groups:
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if rank == 0:
                for _, p in params:  # a copy on GPUs; on CPU the gathered storage itself (the release
                    gathered[id(p)] = p.detach().to("cpu")  # swaps in an empty one, it does not overwrite it)
    if rank != 0:
        return {}, len(groups)
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if name.startswith(prefix):
            out[name] = gathered[id(t)] if id(t) in gathered else t.detach().to("cpu", copy=True)
    return out, len(groups)
