"""The model run on a micro-batch: its rows laid out for the attention kernel, log-probs, values, entropy.

A micro-batch's rows go to the model in one of three layouts (:func:`packs_of`):

- **packed, one forward** (``actor.use_remove_padding``, an attention kernel that reads sequence boundaries
  from restarting position ids: ``flash_attention_2``/``_3``, ``flex_attention``): every row back to back in
  one ``[1, N]`` sequence, position ids restarting at each row; attention memory and time follow the real
  tokens, nothing computed is padding;
- **packed in short packs** (``use_remove_padding`` with ``sdpa`` or ``eager``, e.g. on CPU): those kernels
  mask a pack with an ``N x N`` matrix, so rows are packed only up to :data:`QUADRATIC_PACK_TOKENS` tokens and
  a longer row runs alone, where ``sdpa`` needs no mask at all (its causal kernel: memory linear in tokens);
- **padded** (``use_remove_padding: false``): the rows right-padded to the micro-batch's longest, with an
  attention mask: the classic layout, cheapest for many short rows of equal length.

Each forward returns, for the positions that predict response tokens only, the log-probs (and entropy or
score norms, and values with a value head; :class:`hpcrl.trainer.models.PolicyWithValueHead`); they are put
back into the micro-batch's ``[b, L]`` per-token layout here. Padding never reaches the output layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hpcrl.trainer.batch import Batch

VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations that keep packed sequences apart from restarting position ids without an
``N x N`` mask (transformers' names)."""
QUADRATIC_PACK_TOKENS = 512
"""Longest pack for a kernel that masks packs with an ``N x N`` matrix (``sdpa``, ``eager``): its mask and
attention weights grow with the square of the pack (at 512 tokens and 14 heads, 15 MB a layer)."""


@dataclass
class Pack:
    """One forward's inputs: ``S`` sequences of ``T`` positions and which positions' hidden states predict a
    response token (row by row, position by position: the order of the micro-batch's response tokens)."""

    input_ids: torch.Tensor                 # [S, T]
    position_ids: torch.Tensor              # [S, T]
    attention_mask: Optional[torch.Tensor]  # [S, T] (padded rows) or None (packed: boundaries from positions)
    picks: torch.Tensor                     # [M] flat indices into the S * T positions
    targets: torch.Tensor                   # [M] the response tokens those positions predict


def _packed(micro: Batch, rows: list[int], device) -> Pack:
    seqs = [micro.sequence(b) for b in rows]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    picks, start = [], 0
    for b, s in zip(rows, seqs):
        P = int(micro.prompt_lens[b])
        picks.append(torch.arange(start + P - 1, start + len(s) - 1))
        start += len(s)
    tokens = torch.cat(seqs)
    return Pack(tokens[None].to(device), positions[None].to(device), None, torch.cat(picks).to(device),
                _targets(micro, rows).to(device))


def _padded(micro: Batch, rows: list[int], pad_id: int, device) -> Pack:
    seqs = [micro.sequence(b) for b in rows]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), T), dtype=torch.long)
    picks = []
    for i, (b, s) in enumerate(zip(rows, seqs)):
        ids[i, :len(s)] = s
        attention[i, :len(s)] = 1
        P = int(micro.prompt_lens[b])
        picks.append(torch.arange(i * T + P - 1, i * T + len(s) - 1))
    positions = torch.arange(T).expand(len(rows), -1)
    return Pack(ids.to(device), positions.to(device), attention.to(device), torch.cat(picks).to(device),
                _targets(micro, rows).to(device))


def _targets(micro: Batch, rows: list[int]) -> torch.Tensor:
    return torch.cat([micro.targets[b, :int(micro.resp_lens[b])] for b in rows])


def packs_of(micro: Batch, *, remove_padding: bool, attn: str, pad_id: int, device) -> list[Pack]:
    """The micro-batch's rows as forwards (module docstring), in row order."""
    rows = list(range(len(micro)))
    if not remove_padding:
        return [_padded(micro, rows, pad_id, device)]
    if attn in VARLEN_KERNELS:
        return [_packed(micro, rows, device)]
    packs, current, used = [], [], 0
    for b in rows:
        n = int(micro.seq_lens[b])
        if current and used + n > QUADRATIC_PACK_TOKENS:
            packs.append(current)
            current, used = [], 0
        current.append(b)
        used += n
    if current:
        packs.append(current)
    return [_packed(micro, p, device) for p in packs]


def unflatten(flat: torch.Tensor, resp_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[M] values of the response tokens, row by row -> [b, width], zero past each row's response."""
    valid = torch.arange(width, device=flat.device)[None, :] < resp_lens.to(flat.device)[:, None]
    out = flat.new_zeros(valid.shape)
    return out.masked_scatter(valid, flat)


@dataclass
class Layout:
    """How this trainer runs its model on a micro-batch (from ``actor.*`` and the loaded model)."""

    remove_padding: bool
    """``actor.use_remove_padding``."""
    attn: str
    """The model's attention implementation (transformers' name)."""
    pad_id: int
    chunk_rows: int
    """Rows of logits per chunk (:func:`hpcrl.trainer.logprobs.chunk_rows`)."""


def run_model(module, micro: Batch, temperature: float, layout: Layout, device, extra: Optional[str] = None,
              extra_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(logp, extra, values)`` of the micro-batch's response tokens, each ``[b, L]`` (zero past a row's
    response; extra and values may be None). ``module`` is a DeepSpeed engine around a
    :class:`~hpcrl.trainer.models.PolicyWithValueHead`, or such a module itself (the reference)."""
    outs = [module(pack, temperature=temperature, chunk_rows=layout.chunk_rows, extra=extra, extra_grad=extra_grad)
            for pack in packs_of(micro, remove_padding=layout.remove_padding, attn=layout.attn,
                                 pad_id=layout.pad_id, device=device)]
    width = micro.targets.shape[1]

    def put(i: int) -> Optional[torch.Tensor]:
        if outs[0][i] is None:
            return None
        return unflatten(torch.cat([o[i] for o in outs]), micro.resp_lens, width)

    return put(0), put(1), put(2)


def logprobs_of(model, batch: Batch, temperature: float, extra: Optional[str] = None, chunk_mib: float = 256.0
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``run_model`` of a whole batch, packed, on the model's own device: for a reader outside the update (a Hugging
    Face causal LM, or a :class:`~hpcrl.trainer.models.PolicyWithValueHead`)."""
    from hpcrl.trainer.logprobs import chunk_rows
    from hpcrl.trainer.models import PolicyWithValueHead

    module = model if isinstance(model, PolicyWithValueHead) else PolicyWithValueHead(model, value_head=False)
    config = module.policy.config
    layout = Layout(True, config._attn_implementation, config.pad_token_id or 0, chunk_rows(chunk_mib, config.vocab_size))
    device = next(module.parameters()).device
    return run_model(module, batch, temperature, layout, device, extra=extra)
