"""Which rows of a mini-batch each trainer rank runs, and in which micro-batches.

Two rules, chosen by ``actor.use_dynamic_bsz`` (verl's name and meaning):

- **by rows** (``false``, verl's default): each rank takes an equal, contiguous share of the
  mini-batch's rows, cut into micro-batches of ``actor.ppo_micro_batch_size`` groups (x ``rollout.n``
  rows);
- **by tokens** (``true``): the rows are dealt to the ranks so that their token counts are balanced
  (longest first, each to the rank with the fewest tokens so far), then each rank packs its rows into
  micro-batches of at most ``actor.ppo_max_token_len_per_gpu`` tokens (prompt + response) by
  first-fit-decreasing. A row longer than the budget gets a micro-batch of its own (it is never cut: a
  trajectory is one sequence; sequence parallelism is what splits one).

Every rank runs the **same number** of micro-batches, which ZeRO-3 (a collective in every forward) and the
gradient-accumulation boundary need: a rank with fewer splits its largest micro-batches, and a rank with
fewer rows than micro-batches runs empty ones (a forward of nothing that adds zero to the gradient).
Every rank computes the same plan from the same lengths (all ranks hold the whole batch), so no
message is needed to agree on it. The loss denominators stay the mini-batch's, so the packing changes
how the work is cut, never the loss.
"""
from __future__ import annotations

import heapq
from typing import Sequence


def split_rows(n_rows: int, world: int) -> list[list[int]]:
    """Equal contiguous shares of ``n_rows`` rows for ``world`` ranks (the by-rows rule; the config makes
    ``n_rows`` a multiple of ``world``)."""
    per = n_rows // world
    return [list(range(r * per, (r + 1) * per)) for r in range(world)]


def balance_rows(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Rows dealt to ``world`` ranks with balanced token counts: longest first, each to the rank with the
    fewest tokens so far (ties: the lower rank). Each rank's rows are returned in ascending order."""
    heap = [(0, r) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
    return [sorted(s) for s in shares]


def pack_rows(rows: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """``rows`` packed into bins of at most ``budget`` tokens by first-fit-decreasing (a row over the budget
    alone in its bin); each bin's rows ascending, bins in order of their first row."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """``bins`` cut into exactly ``count`` (>= len(bins)): the bin with the most tokens that has two rows or more
    is halved by tokens, again and again; what cannot be cut further is padded with empty bins."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        cuttable = [b for b in bins if len(b) > 1]
        if not cuttable:
            bins += [[] for _ in range(count - len(bins))]
            break
        big = max(cuttable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(big)
        half = balance_rows([lengths[i] for i in big], 2)
        bins += [[big[j] for j in half[0]], [big[j] for j in half[1]]]
    return sorted(bins, key=lambda b: b[0] if b else 1 << 62)


def micro_batches(lengths: Sequence[int], world: int, *, budget_tokens: int | None, rows_per_micro: int
                  ) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of row indices into ``lengths`` (the mini-batch's rows' token
    counts). ``budget_tokens`` None: the by-rows rule (``rows_per_micro`` rows each); otherwise the by-tokens
    rule (module docstring). Every rank gets the same number of micro-batches."""
    if budget_tokens is None:
        shares = split_rows(len(lengths), world)
        return [[share[u:u + rows_per_micro] for u in range(0, len(share), rows_per_micro)] or [[]]
                for share in shares]
    shares = balance_rows(lengths, world)
    per_rank = [pack_rows(share, lengths, budget_tokens) if share else [] for share in shares]
    count = max(1, max(len(p) for p in per_rank))
    return [_split_to(p, count, lengths) for p in per_rank]


def chunks_by_tokens(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Consecutive rows in chunks of at most ``budget_tokens`` tokens (a longer row alone): the no-grad passes
    (log-probs before the update, the reference, old values), which need no balance between ranks' steps."""
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if out and used + n <= budget_tokens:
            out[-1].append(i)
            used += n
        else:
            out.append([i])
            used = n
    return out
