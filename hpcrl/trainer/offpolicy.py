"""Off-policy corrections for stale and mismatched samples: IS weights, rejection masks, lag masks.

Three policies (decoupled PPO, Hilton et al. 2021; AReaL; verl's "rollout correction"):

- mu, the **behaviour** policy: the engine's log-probs of the sampled tokens,
  stored per token in the shard (after temperature / top-p);
- pi_prox, the **proximal** policy: the trainer's own log-probs under its
  weights at the start of the local update (``compute_prox_log_prob``, or
  ``use_rollout_log_probs=false``); it is the PPO anchor;
- pi_theta, the policy being optimised.

The PPO ratio pi_theta / pi_prox keeps each update in a trust region; the
importance weight rho = pi_prox / mu corrects for sampling from mu (an older
weight version, or the same weights in a different engine). Per token,
``log rho_t = log pi_prox(y_t) - log mu(y_t)`` (clamped to +-20 before exp).

``algorithm.rollout_correction``:

- ``rollout_is = token``:    w_t = min(rho_t, C)
- ``rollout_is = sequence``: w_t = min(prod_t' rho_t', C) for every token of the sequence
  (truncated IS, "TIS"; C = ``rollout_is_threshold``). The weight multiplies the
  per-token PPO loss and carries no gradient.
- ``rollout_rs`` rejects (masks out of the loss and of its denominator) what
  falls outside [lower, upper] (lower defaults to 1 / upper):
  ``token``: rho_t; ``sequence``: prod rho_t; ``geometric``: exp(mean_t log rho_t).
- ``rollout_token_veto_threshold`` = v: a sequence with any token rho_t < v is rejected.
- ``max_token_lag`` = k: tokens generated k+1 or more versions ago are masked
  (lag_t = trainer_version - token_version_t, from the per-token versions the
  rollout job wrote). Needs no proximal log-probs.

Metrics (``rollout_corr/*``): the mismatch KL(mu || pi_prox) estimated from the
samples as k1 = mean(log mu - log pi_prox) and k3 = mean(rho - 1 - log rho);
IS weight mean/max/min before truncation and the truncated fraction; the
fractions of tokens rejected by each mask and in total.
"""
from __future__ import annotations

from typing import Optional

import torch

from hpcrl.config.names import IS_LEVELS, RS_LEVELS



def _mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1))


def _seq_broadcast(per_seq: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None].expand_as(like)


def _ratio(log_rho: torch.Tensor, m: torch.Tensor, level: str, knob: str, allowed: tuple[str, ...]) -> torch.Tensor:
    """[B, L] ratio at ``level``: per token, the sequence product, or its geometric mean."""
    if level not in allowed:
        raise ValueError(f"unknown {knob} level {level!r}; allowed: {', '.join(allowed)}")
    lr = torch.clamp(log_rho, -20.0, 20.0) * m
    if level == "token":
        return torch.exp(lr)
    if level == "sequence":
        return _seq_broadcast(torch.exp(torch.clamp(lr.sum(dim=1), -20.0, 20.0)), lr)
    return _seq_broadcast(torch.exp(lr.sum(dim=1) / m.sum(dim=1).clamp(min=1)), lr)


def importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated weights, untruncated weights), both [B, L] and 0 where mask is 0."""
    m = mask.float()
    raw = _ratio(log_rho, m, level, "rollout_is", IS_LEVELS)
    return torch.clamp(raw, max=threshold) * m, raw * m


def rejection_mask(log_rho: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float) -> torch.Tensor:
    """1 = keep, 0 = rejected; [B, L]."""
    r = _ratio(log_rho, mask.float(), level, "rollout_rs", RS_LEVELS)
    return ((r >= lower) & (r <= upper)).float()


def veto_mask(log_rho: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """0 for every token of a sequence holding a mask-1 token with rho_t < threshold."""
    bad = (torch.exp(log_rho) < threshold) & (mask > 0)
    return _seq_broadcast((~bad.any(dim=1)).float(), log_rho)


def lag_mask(token_lag: torch.Tensor, max_lag: int) -> torch.Tensor:
    """0 for tokens sampled more than ``max_lag`` versions before the trainer's version."""
    return (token_lag <= max_lag).float()


def correct(mask: torch.Tensor, *, prox_logp: Optional[torch.Tensor], behav_logp: torch.Tensor,
            token_lag: Optional[torch.Tensor] = None, rollout_is: Optional[str] = None,
            rollout_is_threshold: float = 2.0, rollout_rs: Optional[str] = None,
            rollout_rs_threshold: Optional[float] = None, rollout_rs_threshold_lower: Optional[float] = None,
            rollout_token_veto_threshold: Optional[float] = None, max_token_lag: Optional[int] = None
            ) -> tuple[Optional[torch.Tensor], torch.Tensor, dict]:
    """(IS weights or None, loss mask, metrics). ``prox_logp`` None = no proximal log-probs
    (bypass mode: the anchor is mu itself); then only the lag mask may apply."""
    m = mask.float()
    keep = torch.ones_like(m)
    weights = None
    stats: dict[str, float] = {}
    n = m.sum().clamp(min=1)
    if prox_logp is not None:
        log_rho = (prox_logp - behav_logp) * m
        rho = torch.exp(torch.clamp(log_rho, -20.0, 20.0))
        stats["rollout_corr/kl"] = _mean(-log_rho, m)
        stats["rollout_corr/k3_kl"] = _mean(rho - 1.0 - log_rho, m)
        if rollout_is is not None:
            weights, raw = importance_weights(log_rho, m, rollout_is, rollout_is_threshold)
            sel = raw[m > 0]
            stats.update({"rollout_corr/rollout_is_mean": float(sel.mean()) if sel.numel() else 1.0,
                          "rollout_corr/rollout_is_max": float(sel.max()) if sel.numel() else 1.0,
                          "rollout_corr/rollout_is_min": float(sel.min()) if sel.numel() else 1.0,
                          "rollout_corr/rollout_is_truncated_fraction": _mean((raw > rollout_is_threshold).float(), m)})
        if rollout_rs is not None:
            upper = rollout_rs_threshold if rollout_rs_threshold is not None else rollout_is_threshold
            lower = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / upper
            rs = rejection_mask(log_rho, m, rollout_rs, upper, lower)
            stats["rollout_corr/rollout_rs_masked_fraction"] = float(((1 - rs) * m).sum() / n)
            keep = keep * rs
        if rollout_token_veto_threshold is not None:
            veto = veto_mask(log_rho, m, rollout_token_veto_threshold)
            stats["rollout_corr/rollout_veto_fraction"] = float(((1 - veto) * m).sum() / n)
            keep = keep * veto
    elif rollout_is is not None or rollout_rs is not None or rollout_token_veto_threshold is not None:
        raise ValueError("importance weights and rejection need the proximal log-probs (prox_logp)")
    if token_lag is not None:
        stats["fully_async/token_lag/mean"] = _mean(token_lag.float(), m)
        stats["fully_async/token_lag/max"] = float(token_lag[m > 0].max()) if bool((m > 0).any()) else 0.0
        if max_token_lag is not None:
            lm = lag_mask(token_lag, max_token_lag)
            stats["rollout_corr/lag_masked_fraction"] = float(((1 - lm) * m).sum() / n)
            keep = keep * lm
    loss_mask = m * keep
    stats["rollout_corr/masked_fraction"] = float((m - loss_mask).sum() / n)
    return weights, loss_mask, stats
