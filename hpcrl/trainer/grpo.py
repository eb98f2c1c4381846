"""GRPO advantages and the PPO clipped policy loss (token-mean over the mini-batch).

For group ``g`` with rewards ``r_1..r_n``:  ``A_i = (r_i - mean(r)) / (std(r) + eps)``
(without the division when ``norm_adv_by_std_in_grpo`` is false); every response
token of trajectory ``i`` gets ``A_i``.

PPO clip, with ``ratio = exp(logp - logp_old)``:
``loss_t = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``, averaged over
tokens with response mask 1. ``logp_old`` is the behaviour policy: the engine's
log-probs (``use_rollout_log_probs``) or the trainer's own before the update.
"""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool, eps: float = 1e-6
                    ) -> torch.Tensor:
    """Per-trajectory advantages; ``group_index[i]`` says which group trajectory i is in."""
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_index):
        sel = group_index == g
        r = rewards[sel]
        centred = r - r.mean()
        if norm_by_std:
            std = r.std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + eps)
        adv[sel] = centred
    return adv


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target_t) under softmax(logits_t / temperature)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def ppo_clip_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_ratio: float, n_tokens_total: int) -> tuple[torch.Tensor, dict]:
    """Sum of clipped per-token losses divided by ``n_tokens_total`` (the whole mini-batch's
    mask-1 tokens, so micro-batches add up to the token mean)."""
    ratio = torch.exp(logp - logp_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    m = mask.float()
    loss = (per_token * m).sum() / max(n_tokens_total, 1)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        stats = {"actor/pg_clipfrac": float(((clipped > unclipped).float() * m).sum() / n),
                 "actor/ratio_mean": float((ratio * m).sum() / n),
                 "actor/ppo_kl": float(((logp_old - logp) * m).sum() / n)}
    return loss, stats
