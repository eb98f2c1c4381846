"""Policy and value losses on ``[B, L]`` per-token tensors, and their aggregation.

Only tokens with ``mask`` 1 count: the mask is the response mask (model tokens)
times any rejection mask from :mod:`hpcrl.trainer.offpolicy`.

**Aggregation** (``actor.loss_agg_mode``, verl's names), for a per-token loss l
over a mini-batch of sequences S (those with at least one mask-1 token):

- ``token-mean``:              sum_{i,t} m l / sum_{i,t} m
- ``token-sum``:               sum_{i,t} m l
- ``seq-mean-token-sum``:      (1/|S|) sum_i sum_t m l
- ``seq-mean-token-mean``:     (1/|S|) sum_i (sum_t m l / sum_t m)
- ``seq-mean-token-sum-norm``: (1/(|S| H)) sum_i sum_t m l, H a constant
  (``actor.loss_scale_factor``, default the response-length budget: Dr. GRPO's
  length-independent normaliser)

The denominators are those of the whole mini-batch (``n_tokens`` and
``n_seqs``), so the losses of its micro-batches add up to the mini-batch loss
exactly, whatever their lengths.

The policy-loss modes other than PPO's (``actor.policy_loss.loss_mode``) are in
:mod:`hpcrl.trainer.policy_losses`.

**PPO clip** with ratio r = exp(logp - logp_old) (log-ratio clamped to +-20):
``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; with dual clip
(``actor.clip_ratio_c`` = c > 1, Ye et al. 2020), tokens with A < 0 use
``min(l, -A c)``, which bounds the loss when r is far above 1. Each token's loss
is multiplied by its (detached) importance weight w (1 without off-policy
correction). The gradient is zero where the clip is active: A > 0 with
r > 1 + eps_high, A < 0 with r < 1 - eps_low, and A < 0 with r > c.

**Entropy bonus**: loss -= entropy_coeff * agg(H_t), H_t = -sum_v p_v log p_v.

**Value loss** (clipped, PPO2-style): with old values V_old and returns R,
``l = 0.5 * max((V - R)^2, (clip(V, V_old - c_v, V_old + c_v) - R)^2)``;
``critic/vf_clipfrac`` is the fraction of tokens where the clipped error is the larger.
"""
from __future__ import annotations

from typing import Optional

import torch

from hpcrl.config.names import LOSS_AGG_MODES  # the allowed names live with the config


def agg_counts(mask: torch.Tensor) -> tuple[int, int]:
    """(mask-1 tokens, sequences with at least one) of a mini-batch: the denominators of :func:`agg_loss`."""
    return int(mask.sum()), int((mask.sum(dim=-1) > 0).sum())


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, n_tokens: Optional[int] = None,
             n_seqs: Optional[int] = None, horizon: Optional[int] = None) -> torch.Tensor:
    """Aggregate ``[B, L]`` per-token losses to a scalar; counts default to this batch's own,
    ``horizon`` (H of seq-mean-token-sum-norm) to L."""
    m = mask.float()
    if n_tokens is None or n_seqs is None:
        n_tokens, n_seqs = agg_counts(m)
    masked = torch.where(m > 0, loss_mat * m, torch.zeros_like(loss_mat))  # not even a nan of a masked token
    if mode == "token-mean":
        return masked.sum() / max(n_tokens, 1)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / max(n_seqs, 1) / (horizon if horizon is not None else loss_mat.shape[-1])
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).sum() / max(n_seqs, 1)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def _frac(cond: torch.Tensor, m: torch.Tensor) -> float:
    return float((cond.float() * m).sum() / m.sum().clamp(min=1))


def ppo_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    clip_low: float, clip_high: float, clip_ratio_c: Optional[float] = None,
                    weights: Optional[torch.Tensor] = None, mode: str = "token-mean", n_tokens: Optional[int] = None,
                    n_seqs: Optional[int] = None, horizon: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """Clipped (optionally dual-clipped, importance-weighted) policy loss and its statistics
    (``loss_mode=vanilla``)."""
    m = mask.float()
    log_ratio = torch.clamp(logp - logp_old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        lower = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = agg_loss(per_token, m, mode, n_tokens, n_seqs, horizon)
    with torch.no_grad():
        sel = ratio[m > 0]
        stats = {"actor/pg_clipfrac": _frac(clipped > unclipped, m),
                 "actor/pg_clipfrac_lower": _frac(lower, m),
                 "actor/ppo_kl": float(((-log_ratio) * m).sum() / m.sum().clamp(min=1)),
                 "actor/ratio_mean": float(sel.mean()) if sel.numel() else 1.0,
                 "actor/ratio_max": float(sel.max()) if sel.numel() else 1.0,
                 "actor/ratio_min": float(sel.min()) if sel.numel() else 1.0}
    return loss, stats


def entropy_from_logp(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] normalised log-probs (log_softmax of logits / temperature) -> [...] entropy."""
    return -(logp.exp() * logp).sum(dim=-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, mode: str = "token-mean", n_tokens: Optional[int] = None,
               n_seqs: Optional[int] = None, horizon: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (0.5 * the larger squared error) and its statistics."""
    m = mask.float()
    # clamp V itself, not V_old + clamp(V - V_old): the round trip through the difference
    # changes unclipped values in the last bit, and those were then counted as clipped
    clipped_v = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped_v - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), m, mode, n_tokens, n_seqs, horizon)
    with torch.no_grad():
        stats = {"critic/vf_clipfrac": _frac(l2 > l1, m),
                 "critic/vpred_mean": float((values * m).sum() / m.sum().clamp(min=1))}
    return loss, stats
