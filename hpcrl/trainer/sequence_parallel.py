"""Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size`` = sp > 1): one sequence across sp ranks.

DeepSpeed's Ulysses for Hugging Face models (``UlyssesSPAttentionHF.register_with_transformers``) replaces the
model's attention function: each rank holds 1/sp of a pack's tokens, and around the attention an all-to-all trades
the sequence split for a split of the heads, so every rank attends over the whole sequence with its share of the
heads. The ranks ``[g sp, (g + 1) sp)`` form sequence-parallel group g (DeepSpeed's layout) and run the same
micro-batches; the groups share the mini-batch as data-parallel ranks do (hpcrl/trainer/packing.py, over
world / sp), and DeepSpeed averages gradients over them only.

Here, around the model's forward (:func:`shard`, :func:`gather`): a pack of N tokens (padded to a multiple of sp
with pad tokens at its end, which causal attention keeps away from the real ones) is cut into sp contiguous slices
with their global position ids; each rank computes the log-probs, entropy and values of the response positions in
its slice, and a differentiable all-gather puts the micro-batch's whole ``[M]`` back on every rank of the group, so
the loss is computed whole on each. Its gradient flows back through the gather (a sum over the group, hence the
loss is divided by sp) and through the attention's all-to-all to the ranks that hold each token.

Which packs: with a kernel that reads sequence boundaries from position ids (flash-attention) the rows of a
micro-batch packed together; with ``sdpa`` (Ulysses drops masks and attends causally over the gathered pack) one
row per pack. Every rank calls the output layer and the value head even for an empty slice: under ZeRO-3 each
call gathers parameters with a collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


_REGISTERED: dict[tuple[str, int], object] = {}
"""(attention kernel, sp) -> DeepSpeed's parallel state: registered once per process (a second model of the same
process, such as a rebuilt trainer's, reuses it)."""


def register(policy, attn: str, sp: int):
    """Ulysses in transformers' attention functions for ``attn`` (a process-wide change), and DeepSpeed's parallel
    state for ``deepspeed.initialize(mpu=...)``; None when sp is 1."""
    if sp == 1:
        return None
    if (attn, sp) not in _REGISTERED:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        _REGISTERED[(attn, sp)] = UlyssesSPAttentionHF.register_with_transformers(
            policy, core_attn_implementation=attn, sequence_parallel_size=sp, micro_batch_size=1,
            seq_length_is_variable=True)
    return _REGISTERED[(attn, sp)]


def group():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


def shard(pack, sp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice, list[int]]:
    """This rank's slice of ``pack`` (N a multiple of sp): ``(input_ids [1, N/sp], position_ids [1, N/sp], its picks
    as indices into the slice, its share of the pack's targets, every rank's count of picks)``."""
    rank = dist.get_rank(group=group())
    n = pack.input_ids.shape[1] // sp
    bounds = [r * n for r in range(sp + 1)]
    counts = [int(((pack.picks >= bounds[r]) & (pack.picks < bounds[r + 1])).sum()) for r in range(sp)]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    return (pack.input_ids[:, bounds[rank]:bounds[rank + 1]], pack.position_ids[:, bounds[rank]:bounds[rank + 1]],
            pack.picks[mine] - bounds[rank], mine, counts)


def gather(local: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's ``[counts[r]]`` values, in rank order, on every rank of the group; differentiable (its backward
    sums the group's gradients into each rank's own slice)."""
    from torch.distributed.nn.functional import all_gather

    width = max(counts)
    padded = torch.cat([local, local.new_zeros(width - local.shape[0])]) if local.shape[0] < width else local
    parts = all_gather(padded, group=group())
    return torch.cat([p[:c] for p, c in zip(parts, counts)])
