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
  per-token PPO loss and carries no gradient. With ``rollout_is_threshold = "lower_upper"``
  (IcePop, verl 0.9.1) the weight is the ratio itself inside [lower, upper] and 0 outside
  (the token or sequence stays in the loss's denominators, unlike rejection).
  ``rollout_is_batch_normalize`` divides w by its mean over the batch (tokens for
  ``token``, sequences for ``sequence``).
- ``rollout_rs`` rejects (masks out of the loss and of its denominator; with
  ``mask_before_advantages`` also out of advantages and critic targets) by a
  divergence statistic of log rho, verl 0.9.1's options, with
  k1_t = -log rho_t = log(mu / pi_prox), k2_t = (log rho_t)^2 / 2, k3_t = rho_t - 1 - log rho_t:
  ``token_k1`` keeps a token with log lower <= k1_t <= log upper, i.e. lower <= 1/rho_t <= upper;
  ``seq_sum_k1`` / ``seq_mean_k1`` keep a sequence with the sum / mean of k1_t in
  [log lower, log upper] (prod_t 1/rho_t resp. its geometric mean in [lower, upper]);
  ``token_k2/k3`` keep k_t <= upper; ``seq_sum_k2/k3``, ``seq_mean_k2/k3``, ``seq_max_k2/k3``
  keep a sequence whose sum / mean / max of k_t is <= upper. A comma-separated list
  keeps what every option keeps. Bounds from ``rollout_rs_threshold``
  (:func:`hpcrl.config.algorithm.rs_thresholds`).
- ``rollout_token_veto_threshold`` = v: a sequence with any token rho_t < v is rejected.
- ``max_token_lag`` = k: tokens generated k+1 or more versions ago are masked
  (lag_t = trainer_version - token_version_t, from the per-token versions the
  rollout job wrote). Needs no proximal log-probs.

Metrics (``rollout_corr/*``): the mismatch KL(mu || pi_prox) estimated from the
samples as k1 = mean(log mu - log pi_prox) and k3 = mean(rho - 1 - log rho);
chi^2 divergences ``chi2_token`` = mean_t(rho_t^2) - 1 and ``chi2_seq`` =
mean_i((prod_t rho_t)^2) - 1 (the variance of the IS weights, verl's names);
IS weight mean/max/min before truncation, the truncated fraction and the
effective sample size ``rollout_is_eff_sample_size`` = 1 / mean((w / mean w)^2)
of the applied weights (1 = all equal, -> 0 as a few dominate); the fractions of
tokens rejected by each mask and in total.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from hpcrl.config.algorithm import is_bounds, rs_thresholds
from hpcrl.config.names import IS_LEVELS, RS_OPTIONS


def _mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1))


def _seq_broadcast(per_seq: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None].expand_as(like)


def _ratio(log_rho: torch.Tensor, m: torch.Tensor, level: str, knob: str, allowed: tuple[str, ...]) -> torch.Tensor:
    """[B, L] ratio at ``level``: per token, or the sequence product on every token."""
    if level not in allowed:
        raise ValueError(f"unknown {knob} level {level!r}; allowed: {', '.join(allowed)}")
    lr = torch.clamp(log_rho, -20.0, 20.0) * m
    if level == "token":
        return torch.exp(lr)
    return _seq_broadcast(torch.exp(torch.clamp(lr.sum(dim=1), -20.0, 20.0)), lr)


def importance_weights(log_rho: torch.Tensor, mask: torch.Tensor, level: str, threshold,
                       batch_normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(applied weights, raw weights), both [B, L] and 0 where mask is 0. ``threshold``: a number C
    (truncation, min(rho, C)) or ``"lower_upper"`` (IcePop: rho inside the bounds, 0 outside); with
    ``batch_normalize`` the applied weights are divided by their batch mean."""
    m = mask.float()
    raw = _ratio(log_rho, m, level, "rollout_is", IS_LEVELS)
    lower, upper = is_bounds(threshold)
    if lower is None:
        w = torch.clamp(raw, max=upper) * m
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw)) * m
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / m.sum().clamp(min=1)
        else:  # one weight per sequence: average over sequences, not tokens
            has = m.sum(dim=1) > 0
            mean = w.max(dim=1).values[has].mean() if bool(has.any()) else w.new_tensor(1.0)
        w = w / mean if float(mean) > 1e-8 else w
    return w, raw * m


def _is_stats(weights: torch.Tensor, raw: torch.Tensor, m: torch.Tensor, threshold) -> dict:
    sel = raw[m > 0]
    lower, upper = is_bounds(threshold)
    stats = {"rollout_corr/rollout_is_mean": float(sel.mean()) if sel.numel() else 1.0,
             "rollout_corr/rollout_is_max": float(sel.max()) if sel.numel() else 1.0,
             "rollout_corr/rollout_is_min": float(sel.min()) if sel.numel() else 1.0,
             "rollout_corr/rollout_is_truncated_fraction": _mean((raw > upper).float(), m),
             "rollout_corr/rollout_is_eff_sample_size": effective_sample_size(weights, m)}
    if lower is not None:  # IcePop: the share of weights set to 0 (verl's name)
        stats["rollout_corr/rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).float(), m)
    return stats


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """1 / mean((w / mean w)^2) over mask-1 tokens: 1 when all weights are equal."""
    m = mask.float()
    mean = (weights * m).sum() / m.sum().clamp(min=1)
    second = (((weights / (mean + 1e-8)) ** 2) * m).sum() / m.sum().clamp(min=1)
    return float(1.0 / second) if float(second) > 0 else 1.0


def chi2(log_rho: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean_t rho_t^2 - 1, mean_i (prod_t rho_t)^2 - 1), over mask-1 tokens / sequences with one."""
    m = mask.float()
    lr = torch.clamp(log_rho, -20.0, 20.0) * m
    token = _mean(torch.exp(2 * lr), m) - 1.0
    has = m.sum(dim=1) > 0
    seq = torch.exp(2 * torch.clamp(lr.sum(dim=1), -20.0, 20.0))[has]
    return token, (float(seq.mean()) - 1.0 if seq.numel() else 0.0)


def _seq_stat(x: torch.Tensor, m: torch.Tensor, how: str) -> torch.Tensor:
    """[B] sum, mean or max of x over each row's mask-1 entries (0 for a row without one)."""
    if how == "sum":
        return (x * m).sum(dim=1)
    if how == "mean":
        return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    top = x.masked_fill(m <= 0, float("-inf")).max(dim=1).values
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)


def rejection_mask(log_rho: torch.Tensor, mask: torch.Tensor, rollout_rs: str, threshold) -> tuple[torch.Tensor, dict]:
    """(keep mask [B, L], 1 = keep, and per-option masked fractions) for ``rollout_rs`` with
    ``rollout_rs_threshold`` (verl 0.9.1's options, see the module docstring)."""
    m = mask.float()
    lr = torch.clamp(log_rho, -20.0, 20.0)
    per_token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(m)
    stats: dict[str, float] = {}
    for opt, (lower, upper) in rs_thresholds(rollout_rs, threshold).items():
        if opt not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {opt!r}; allowed: {', '.join(RS_OPTIONS)}")
        level, kind = opt.rsplit("_", 1)
        stat = per_token[kind]
        if level != "token":
            stat = _seq_broadcast(_seq_stat(stat, m, level[len("seq_"):]), m)
        if kind == "k1":  # a log-ratio: bounds on its exponential, 1/rho
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        stats[f"rollout_corr/rollout_rs_{opt}_masked_fraction"] = _mean((~ok).float(), m)
        keep = keep * ok.float()
    return keep, stats


def veto_mask(log_rho: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """0 for every token of a sequence holding a mask-1 token with rho_t < threshold."""
    bad = (torch.exp(log_rho) < threshold) & (mask > 0)
    return _seq_broadcast((~bad.any(dim=1)).float(), log_rho)


def lag_mask(token_lag: torch.Tensor, max_lag: int) -> torch.Tensor:
    """0 for tokens sampled more than ``max_lag`` versions before the trainer's version."""
    return (token_lag <= max_lag).float()


def correct(mask: torch.Tensor, *, prox_logp: Optional[torch.Tensor], behav_logp: torch.Tensor,
            token_lag: Optional[torch.Tensor] = None, rollout_is: Optional[str] = None,
            rollout_is_threshold=2.0, rollout_is_batch_normalize: bool = False,
            rollout_rs: Optional[str] = None, rollout_rs_threshold=None,
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
        stats["rollout_corr/chi2_token"], stats["rollout_corr/chi2_seq"] = chi2(log_rho, m)
        if rollout_is is not None:
            weights, raw = importance_weights(log_rho, m, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
            stats.update(_is_stats(weights, raw, m, rollout_is_threshold))
        if rollout_rs is not None:
            rs, rs_stats = rejection_mask(log_rho, m, rollout_rs, rollout_rs_threshold)
            stats.update(rs_stats)
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
