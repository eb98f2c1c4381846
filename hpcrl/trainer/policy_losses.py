"""Policy losses, chosen by ``actor.policy_loss.loss_mode`` (verl 0.9.1's names and definitions).

All take ``[B, L]`` per-token tensors: log-probs ``logp`` of pi_theta (differentiated), the PPO
anchor ``logp_old``, advantages A, the loss mask m, and optional detached importance weights w
(``rollout_is``). r_t = exp(logp - logp_old) (log-ratio clamped to +-20 where noted), eps_low /
eps_high the clip ratios, sg() a stop-gradient, ``agg`` the ``actor.loss_agg_mode`` of
:func:`hpcrl.trainer.losses.agg_loss` with the mini-batch's counts.

- ``vanilla``:  PPO clip with dual clip (:func:`hpcrl.trainer.losses.ppo_policy_loss`).
- ``gspo``:     s_i = exp(mean_t (logp - logp_old)) (sequence-level geometric-mean ratio);
  per token s_it = sg(s_i) * pi / sg(pi) (value s_i, gradient of log pi_t), log s_it clamped at 10;
  l_t = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)); aggregated with ``loss_agg_mode``
  as verl 0.9.1 does (Zheng et al. 2025; the paper's objective is ``seq-mean-token-mean``).
- ``cispo``:    l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t: the clipped ratio only
  weights the REINFORCE term, so clipped tokens keep their gradient (MiniMax-M1, 2025).
- ``gpg``:      l_t = -A_t logp_t (plain policy gradient; Chu et al. 2025).
- ``clip_cov``: PPO clip (no dual clip, no log-ratio clamp); per micro-batch, cov_t =
  (A_t - mean A)(logp_t - mean logp) over mask-1 tokens; among tokens not already clipped with
  lb < cov_t < ub, max(1, floor(clip_cov_ratio * #tokens)) chosen uniformly at random get loss 0
  (no gradient) (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").
- ``kl_cov``:   l_t = -A_t r_t (no clip), plus ppo_kl_coef * abs(logp_t - logp_old_t) on the
  max(1, floor(kl_cov_ratio * #tokens)) tokens of the micro-batch with the largest cov_t (same paper);
  its ``actor/ppo_kl`` is the mean of abs(logp - logp_old), as verl reports it.
- ``geo_mean``: GMPO (Zhao et al. 2025). Per token, d_t = logp - logp_old clipped towards 0 on the
  side that helps the objective: d'_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -eps_low, eps_high));
  per sequence, rho_i = exp(mean_t d'_t), A_i = mean_t A_t, w_i = exp(mean_t log w_t);
  L = (1/|S|) sum_i -A_i rho_i w_i (its own sequence mean; ``loss_agg_mode`` is not used).
- ``dppo_tv``:  DPPO-Binary-TV (arXiv 2602.04879): l_t = -A_t sg(min(r_t, C)) logp_t v_t, C = ``clip_ratio_c``;
  the trust region is a divergence of the sampled token's probability, not a ratio: with p = pi(y_t),
  q = pi_old(y_t), v_t = 1 if (A_t > 0 and p - q <= eps_high) or (A_t <= 0 and p - q >= -eps_low), else 0
  (``clip_ratio_low/high`` are TV thresholds here). ``pg_clipfrac`` = share with v = 0,
  ``pg_clipfrac_lower`` = share with v = 1 and r > C.
- ``dppo_kl``:  as dppo_tv with the binary KL D = q log(q/p) + (1-q) log((1-q+1e-8)/(1-p+1e-8)):
  v_t = 1 if (A_t > 0 and (D <= eps_high or p <= q)) or (A_t <= 0 and (D <= eps_low or p >= q)).
- ``sapo``:     SAPO (arXiv 2511.20347), a smooth gate instead of a clip: l_t = -f(r_t) A_t,
  f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = ``actor.tau_pos`` where A_t > 0 else ``actor.tau_neg``;
  always aggregated with ``seq-mean-token-mean`` (as verl); clip fractions 0.
- ``dro``:      DRO: l_t = -(A_t logp_t - dro_beta / 2 (logp_t - logp_old_t)^2), a quadratic log-ratio
  penalty instead of a clip (``policy_loss.dro_beta`` > 0 required).

verl 0.9.1's ``bypass_mode`` loss (``algorithm.rollout_correction.bypass_mode``) is not a mode here:
its ``loss_type=ppo_clip`` is ``vanilla`` and ``loss_type=reinforce`` is ``gpg`` (-A w logp), with
weights and rejection computed per micro-batch in :mod:`hpcrl.trainer.update`.

Deviations from verl, on purpose: the covariance selections of clip_cov / kl_cov run per
micro-batch, as verl's do, so they depend on ``ppo_micro_batch_size``; geo_mean divides by the
mini-batch's sequences with at least one loss-mask token (verl: every row of the micro-batch,
rejected ones included), so micro-batch losses add up to the mini-batch loss as for the other modes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hpcrl.config.registries import POLICY_LOSS_MODES, resolve  # the registry of the losses below
from hpcrl.trainer.losses import _frac, agg_counts, agg_loss, ppo_policy_loss


@dataclass
class LossParams:
    """The knobs a policy loss reads (from ``actor`` and ``actor.policy_loss``)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)


def _ppo_kl(log_ratio: torch.Tensor, m: torch.Tensor) -> float:
    return float(_masked_mean(-log_ratio.detach(), m))


def _weighted(per_token: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    return per_token if weights is None else per_token * weights.detach()


def gspo_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = logp - logp_old
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq_log_ratio.detach()[:, None], max=10.0)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1.0 - p.clip_low, 1.0 + p.clip_high)
    per_token = _weighted(torch.maximum(unclipped, clipped), weights)
    loss = agg_loss(per_token, m, **agg)
    return loss, {"actor/pg_clipfrac": _frac(clipped > unclipped, m), "actor/pg_clipfrac_lower": 0.0,
                  "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def cispo_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = torch.clamp(logp - logp_old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high)
    per_token = _weighted(-clipped.detach() * adv * logp, weights)
    loss = agg_loss(per_token, m, **agg)
    return loss, {"actor/pg_clipfrac": _frac(ratio != clipped, m), "actor/pg_clipfrac_lower": 0.0,
                  "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def gpg_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    loss = agg_loss(_weighted(-logp * adv, weights), m, **agg)
    return loss, {"actor/ppo_kl": _ppo_kl(logp - logp_old, m)}


def _covariance(adv: torch.Tensor, logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp), means over mask-1 tokens; no gradient."""
    with torch.no_grad():
        return (adv - _masked_mean(adv, m)) * (logp - _masked_mean(logp, m))


def clip_cov_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = logp - logp_old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - p.clip_low, 1.0 + p.clip_high)
    cov = _covariance(adv, logp, m)
    candidates = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & (m > 0) & ~(clipped > unclipped)
    keep = torch.ones_like(adv)
    idx = candidates.nonzero()
    if len(idx):
        k = max(int(p.clip_cov_ratio * float(m.sum())), 1)
        chosen = idx[torch.randperm(len(idx), device=idx.device)[:k]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    per_token = _weighted(torch.maximum(unclipped, clipped) * keep, weights)
    loss = agg_loss(per_token, m, **agg)
    return loss, {"actor/pg_clipfrac": _frac(keep == 0, m), "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def kl_cov_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = logp - logp_old
    per_token = -adv * torch.exp(log_ratio)
    penalised = torch.zeros_like(m, dtype=torch.bool)
    n = int((m > 0).sum())
    if n:
        cov = _covariance(adv, logp, m).masked_fill(m <= 0, float("-inf")).flatten()
        top = torch.topk(cov, max(1, int(n * p.kl_cov_ratio))).indices
        penalised.view(-1)[top] = True
        per_token = torch.where(penalised, per_token + p.ppo_kl_coef * log_ratio.abs(), per_token)
    loss = agg_loss(_weighted(per_token, weights), m, **agg)
    # verl reports kl_cov's ppo_kl as the mean absolute log-ratio (the others: the signed mean of -log-ratio)
    return loss, {"actor/pg_clipfrac": _frac(penalised, m),
                  "actor/ppo_kl": float(_masked_mean(log_ratio.detach().abs(), m))}


def geo_mean_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = logp - logp_old
    sgn = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -p.clip_low, p.clip_high)
    d = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    length = m.sum(-1)
    rho = torch.exp((d * m).sum(-1) / (length + 1e-8))
    seq_adv = (adv * m).sum(-1) / (length + 1e-8)
    per_seq = -seq_adv * rho
    if weights is not None:
        per_seq = per_seq * torch.exp((torch.log(weights.detach() + 1e-10) * m).sum(-1) / (length + 1e-8))
    per_seq = torch.where(length > 0, per_seq, torch.zeros_like(per_seq))
    loss = per_seq.sum() / max(agg["n_seqs"], 1)
    off = log_ratio != clamped
    return loss, {"actor/pg_clipfrac": _frac(off & (adv > 0), m), "actor/pg_clipfrac_lower": _frac(off & (adv < 0), m),
                  "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def _dppo(valid_fn: Callable, logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    """DPPO's shared part: a detached truncated ratio times log pi, masked by ``valid_fn(logp, logp_old, adv)``."""
    log_ratio = torch.clamp(logp - logp_old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    cap = p.clip_ratio_c if p.clip_ratio_c is not None else float("inf")
    with torch.no_grad():
        valid = valid_fn(logp.detach(), logp_old, adv, p).float()
    per_token = _weighted(-adv * torch.clamp(ratio, max=cap).detach() * logp * valid, weights)
    loss = agg_loss(per_token, m, **agg)
    return loss, {"actor/pg_clipfrac": _frac(valid == 0, m),
                  "actor/pg_clipfrac_lower": _frac((ratio > cap) & (valid > 0), m),
                  "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def _tv_valid(logp, logp_old, adv, p: LossParams) -> torch.Tensor:
    prob, old = torch.exp(logp), torch.exp(logp_old)
    return torch.where(adv > 0, prob - old <= p.clip_high, prob - old >= -p.clip_low)


def _binary_kl_valid(logp, logp_old, adv, p: LossParams) -> torch.Tensor:
    prob, old = torch.exp(logp), torch.exp(logp_old)
    kl = old * (logp_old - logp) + (1 - old) * torch.log((1.0 - old + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(adv > 0, (kl <= p.clip_high) | (prob <= old), (kl <= p.clip_low) | (prob >= old))


def dppo_tv_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    return _dppo(_tv_valid, logp, logp_old, adv, m, p, weights, agg)


def dppo_kl_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    return _dppo(_binary_kl_valid, logp, logp_old, adv, m, p, weights, agg)


def sapo_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    log_ratio = torch.clamp(logp - logp_old, -20.0, 20.0)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    per_token = _weighted(-gate * adv, weights)
    loss = agg_loss(per_token, m, "seq-mean-token-mean", agg["n_tokens"], agg["n_seqs"])
    return loss, {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0, "actor/ppo_kl": _ppo_kl(log_ratio, m)}


def dro_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    if p.dro_beta is None or p.dro_beta <= 0:
        raise ValueError(f"loss_mode dro needs actor.policy_loss.dro_beta > 0, got {p.dro_beta}")
    log_ratio = logp - logp_old
    per_token = _weighted(-(logp * adv - 0.5 * p.dro_beta * log_ratio.square()), weights)
    return agg_loss(per_token, m, **agg), {"actor/ppo_kl": _ppo_kl(log_ratio, m)}


def vanilla_loss(logp, logp_old, adv, m, p: LossParams, weights, agg: dict) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate with dual clip (:func:`hpcrl.trainer.losses.ppo_policy_loss`)."""
    return ppo_policy_loss(logp, logp_old, adv, m, clip_low=p.clip_low, clip_high=p.clip_high,
                           clip_ratio_c=p.clip_ratio_c, weights=weights, **agg)




def policy_loss(loss_mode: str, logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, params: LossParams, *, weights: Optional[torch.Tensor] = None,
                mode: str = "token-mean", n_tokens: Optional[int] = None, n_seqs: Optional[int] = None,
                horizon: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """(loss, statistics) of ``loss_mode``; counts default to this batch's own (see :func:`agg_loss`)."""
    if loss_mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unknown policy loss_mode {loss_mode!r}; allowed: {', '.join(POLICY_LOSS_MODES)}")
    m = mask.float()
    if n_tokens is None or n_seqs is None:
        n_tokens, n_seqs = agg_counts(m)
    agg = {"mode": mode, "n_tokens": n_tokens, "n_seqs": n_seqs, "horizon": horizon}
    return resolve(POLICY_LOSS_MODES[loss_mode])(logp, logp_old, advantages, m, params, weights, agg)
