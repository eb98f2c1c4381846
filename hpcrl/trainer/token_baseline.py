"""Optimal Token Baseline (OTB): ``algorithm.adv_estimator = optimal_token_baseline`` and its
multi-turn form ``tir_optimal_token_baseline`` (verl 0.9.1's names and definitions).

Each token gets its own baseline, a weighted mean over the group of the returns at the same step,
weighted by how much gradient each trajectory has accumulated up to that step:

- G_t = sum_{k >= t} m_k r_k, the return from step t (reward-to-go over every position);
- w_t = ||d log pi(y_t) / d logits||^2 = 1 - 2 pi(y_t) + sum_v pi_v^2, the squared norm of the
  score of the sampled token under the trainer's tempered distribution at the start of the update
  (verl: ``1 - 2 exp(old_log_probs) + sum_pi_squared``), times w_IS^2 when importance weights are on;
- W_t = sum_{j <= t} m_j w_j, the path's accumulated variance proxy;
- B_t = sum_{i in g} m_it G_it W_it / (sum_{i in g} m_it W_it + 1e-8), per step t of group g;
- A_t = (G_t - B_t) m_t; the returns are G.

``handle_zero_tail`` (verl's default, on): when one trajectory of a group is strictly the longest
(by its count of mask-1 tokens), its baseline is 0 from the second-longest length on (no other
trajectory reaches those steps). ``optimal_token_baseline`` aligns steps by position in the padded
response; ``tir_optimal_token_baseline`` aligns them by the index among each trajectory's model
tokens (tool tokens removed), so the turns of multi-turn trajectories line up.

Deviation from verl, as for every group estimator here: a group of one gets advantage 0 (verl: G).
"""
from __future__ import annotations

from typing import Optional

import torch


def score_norm_sq(logp_full: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, L, V] log-probs and [B, L] sampled tokens -> w_t = 1 - 2 pi(y_t) + sum_v pi_v^2."""
    p = logp_full.exp()
    return 1.0 - 2.0 * p.gather(-1, targets.unsqueeze(-1)).squeeze(-1) + p.square().sum(-1)


def _returns(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _group_baseline(G: torch.Tensor, W: torch.Tensor, m: torch.Tensor, lengths: torch.Tensor,
                    zero_tail: bool) -> torch.Tensor:
    """[N, S] baselines of one group whose steps are aligned by column."""
    base = ((G * W * m).sum(0) / ((W * m).sum(0) + 1e-8)).expand_as(G).clone()
    if zero_tail:
        ordered = torch.sort(lengths).values
        longest = (lengths == ordered[-1]).nonzero().squeeze(1)
        if longest.numel() == 1 and ordered[-1] > ordered[-2]:
            base[int(longest[0]), int(ordered[-2]):] = 0.0
    return base


def optimal_token_baseline(token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor,
                           w_token: torch.Tensor, is_weights: Optional[torch.Tensor] = None, zero_tail: bool = True,
                           multi_turn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, L] (module docstring); ``multi_turn`` = the tir_ form."""
    m = mask.float()
    G = _returns(token_rewards, m)
    w = w_token if is_weights is None else w_token * is_weights.square()
    W = (w * m).cumsum(-1)
    lengths = m.sum(-1).long()
    adv = torch.zeros_like(G)
    for g in torch.unique(group_index):
        idx = (group_index == g).nonzero().squeeze(1)
        if multi_turn:
            idx = idx[lengths[idx] > 0]
        if idx.numel() < 2:
            continue
        if not multi_turn:
            base = _group_baseline(G[idx], W[idx], m[idx], lengths[idx], zero_tail)
            adv[idx] = (G[idx] - base) * m[idx]
            continue
        S = int(lengths[idx].max())
        Gc, Wc, mc = (G.new_zeros(idx.numel(), S) for _ in range(3))
        for r, i in enumerate(idx.tolist()):
            sel = m[i] > 0
            n = int(lengths[i])
            Gc[r, :n], Wc[r, :n], mc[r, :n] = G[i, sel], W[i, sel], 1.0
        base = _group_baseline(Gc, Wc, torch.ones_like(mc), lengths[idx], zero_tail)
        for r, i in enumerate(idx.tolist()):
            adv[i, m[i] > 0] = (Gc[r] - base[r])[: int(lengths[i])]
    return adv * m, G
