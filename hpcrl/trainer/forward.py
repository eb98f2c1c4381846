"""The model run on a micro-batch: its rows laid out for the attention kernel, log-probs, values, entropy.

A micro-batch's rows go to the model in one of three layouts (:func:`packs_of`):

- **packed, one forward** (``actor.use_remove_padding``, an attention kernel that reads sequence boundaries
  from restarting position ids: ``flash_attention_2``/``_3``, ``flex_attention``): every row back to back in
  one ``[1, N]`` sequence, position ids restarting at each row; attention memory and time follow the real
  tokens, nothing computed is padding;
- **rows of similar length** (``use_remove_padding`` with ``sdpa`` or ``eager``, e.g. on CPU): those kernels keep
  packed rows apart only with an ``N x N`` mask, so a row over :data:`QUADRATIC_PACK_TOKENS` tokens runs alone
  (``sdpa``'s causal kernel needs no mask: memory linear in its tokens) and shorter rows are padded together, longest
  first, with at most :data:`PADDED_WASTE` of padding;
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
"""For a kernel that cannot keep packed rows apart without an ``N x N`` mask (``sdpa``, ``eager``): rows longer than
this run alone (sdpa's causal kernel needs no mask, its memory is linear in tokens), shorter ones are padded together
(:data:`PADDED_WASTE`); the masks and attention weights of such a batch grow with its rows x width squared."""
PADDED_WASTE = 0.25
"""Rows padded together for such a kernel: at most this share of padding over their real tokens."""


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


def _to_multiple(pack: Pack, sp: int, pad_id: int) -> Pack:
    """``pack`` with pad tokens at its end up to a multiple of ``sp`` positions (their positions continuing)."""
    n = pack.input_ids.shape[1]
    extra = -n % sp
    if not extra:
        return pack
    last = pack.position_ids[:, -1:]
    more = last + torch.arange(1, extra + 1, device=last.device)
    return Pack(torch.cat([pack.input_ids, pack.input_ids.new_full((1, extra), pad_id)], 1),
                torch.cat([pack.position_ids, more], 1), None, pack.picks, pack.targets)


def packs_of(micro: Batch, *, remove_padding: bool, attn: str, pad_id: int, device,
             sp: int = 1) -> list[tuple[list[int], Pack]]:
    """The micro-batch's rows as forwards (module docstring): ``(rows, pack)`` pairs, every row in one of them; with
    sequence parallelism (sp > 1) each pack padded to a multiple of sp, and one row per pack unless the kernel keeps
    packed rows apart."""
    rows = list(range(len(micro)))
    if sp > 1:
        groups = [rows] if attn in VARLEN_KERNELS else [[b] for b in rows]
        return [(g, _to_multiple(_packed(micro, g, device), sp, pad_id)) for g in groups]
    if not remove_padding:
        return [(rows, _padded(micro, rows, pad_id, device))]
    if attn in VARLEN_KERNELS:
        return [(rows, _packed(micro, rows, device))]
    return [(g, _packed(micro, g, device) if len(g) == 1 else _padded(micro, g, pad_id, device))
            for g in _similar_lengths(micro.seq_lens.tolist())]


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Rows for a kernel without packing (sdpa, eager), longest first: a row over :data:`QUADRATIC_PACK_TOKENS`
    alone (no mask: sdpa's causal kernel, memory linear in its tokens), shorter ones padded together while the
    padding stays under :data:`PADDED_WASTE` of the real tokens and the batch under the same bound per row."""
    groups: list[list[int]] = []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        n = lengths[b]
        g = groups[-1] if groups else None
        if g is not None and lengths[g[0]] <= QUADRATIC_PACK_TOKENS:
            width = lengths[g[0]]  # the group's longest (rows come longest first)
            real = sum(lengths[r] for r in g) + n
            if (len(g) + 1) * width <= (1 + PADDED_WASTE) * real:
                g.append(b)
                continue
        groups.append([b])
    return groups


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
    sp: int = 1
    """``actor.ulysses_sequence_parallel_size``: ranks a pack is split over (hpcrl/trainer/sequence_parallel.py)."""
    same_forwards: bool = False
    """Every forward is a collective of all ranks (ZeRO-3 gathers each layer's parameters as it runs), so every rank
    runs as many forwards per micro-batch as the rank with the most packs: :func:`run_model` adds stand-in packs."""


def run_model(module, micro: Batch, temperature: float, layout: Layout, device, extra: Optional[str] = None,
              extra_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(logp, extra, values)`` of the micro-batch's response tokens, each ``[b, L]`` (zero past a row's
    response; extra and values may be None). ``module`` is a DeepSpeed engine around a
    :class:`~hpcrl.trainer.models.PolicyWithValueHead`, or such a module itself (the reference)."""
    packs = packs_of(micro, remove_padding=layout.remove_padding, attn=layout.attn, pad_id=layout.pad_id,
                     device=device, sp=layout.sp)
    stand_ins = _stand_ins_needed(len(packs), layout, device)  # before any forward: a forward's hooks are collectives
    outs = [module(pack, temperature=temperature, chunk_rows=layout.chunk_rows, extra=extra, extra_grad=extra_grad,
                   sp=layout.sp) for _, pack in packs]
    for _ in range(stand_ins):
        ran = module(_stand_in_pack(layout, device), temperature=temperature, chunk_rows=layout.chunk_rows, extra=extra,
                     extra_grad=extra_grad, sp=layout.sp)
        outs[0] = tuple(o if o is None or r is None else o + 0.0 * r.sum()  # in the graph: its backward runs too
                        for o, r in zip(outs[0], ran))
    order = torch.tensor([b for rows, _ in packs for b in rows])  # the packs' rows, in the order they ran
    lens = micro.resp_lens[order]
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order))  # row b ran as the back[b]-th

    def put(i: int) -> Optional[torch.Tensor]:
        if outs[0][i] is None:
            return None
        ran = unflatten(torch.cat([o[i] for o in outs]), lens, micro.targets.shape[1])
        return ran if torch.equal(order, torch.arange(len(order))) else ran[back.to(ran.device)]

    return put(0), put(1), put(2)


def _stand_ins_needed(n_packs: int, layout: Layout, device) -> int:
    """How many packs fewer than the rank with the most this rank runs for this micro-batch (0 unless
    ``layout.same_forwards``): the kernels without packing cut a micro-batch into as many packs as its lengths ask.
    Asked before the micro-batch's first forward: ZeRO-3's hook at the start of a forward may itself be a collective
    (its trace check), which a rank asking here after its last pack would never meet."""
    if not layout.same_forwards:
        return 0
    most = torch.tensor([n_packs], device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item()) - n_packs


def _stand_in_pack(layout: Layout, device) -> Pack:
    """A forward of pad tokens predicting one pad token (added to the micro-batch's outputs times 0: its gradient is
    zeros, its collectives those of any forward and backward)."""
    ids = torch.full((1, max(2, layout.sp)), layout.pad_id, dtype=torch.long, device=device)
    positions = torch.arange(ids.shape[1], device=device)[None]
    return Pack(ids, positions, None, torch.tensor([0], device=device),
                torch.tensor([layout.pad_id], device=device))


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
