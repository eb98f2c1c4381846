"""The built-in advantage estimators (verl's names and semantics), each one function
``estimate_<name>(x: AdvantageInputs) -> (advantages, returns)`` behind :mod:`hpcrl.trainer.advantages`, named in
:data:`hpcrl.config.registries.ADV_ESTIMATORS` with what it needs. Outcome estimators use the trajectory score
``s_i = sum_t token_rewards[i, t]`` and the group of each trajectory.

- ``gae``:  delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}
  over mask-1 tokens only (a tool token is not a step: values and deltas skip
  it), V after the last token = 0; returns R_t = A_t + V_t (the critic's
  target); advantages are then whitened over the batch's mask-1 tokens.
  With lam = 1: A_t = sum_k gamma^k r_{t+k} - V_t (discounted return minus value).
- ``grpo``: A_i = (s_i - mean_g(s)) / (std_g(s) + eps) (unbiased std), or
  s_i - mean_g(s) without ``norm_adv_by_std_in_grpo`` (Dr. GRPO).
- ``rloo``: A_i = s_i - mean_{j in g, j != i} s_j = n/(n-1) * (s_i - mean_g(s)).
  ``grpo_vectorized`` and ``rloo_vectorized`` (verl's vectorised implementations) are aliases.
- ``reinforce_plus_plus``: R_t = sum_k gamma^k r_{t+k} (mask-1 steps), then
  whitened over the batch: A = (R - mean(R)) / sqrt(var(R) + 1e-8).
- ``reinforce_plus_plus_baseline``: A_i = s_i - mean_g(s) on every token, then
  whitened over the batch.
- ``opo``:  A_i = s_i - b_g, b_g = sum_{j in g} |y_j| s_j / sum_{j in g} |y_j|, the
  length-weighted group mean (|y_j| = trained tokens of j; Hao et al. 2025, "On-Policy RL
  with Optimal reward baseline").
- ``grpo_passk``: only the best trajectory of each group (the first if tied) gets
  A = (s_max - s_second) / (std_g(s) + eps) (no division without
  ``norm_adv_by_std_in_grpo``); the others get 0 (Pass@k training, Chen et al. 2025).
- ``gpg``:  A_i = alpha (s_i - mean_g(s)), alpha = B / #{i : s_i != 0} over the B
  trajectories of the batch (at least one counted) (Chu et al. 2025, GPG).
- ``gdpo``: per reward component k, grpo's A_ik; then A = whiten(sum_k c_k A_ik) over the batch's
  tokens (Group reward-Decoupled normalisation, arXiv 2601.05242). The shards hold one reward per
  trajectory, so here K = 1: whiten(grpo) (verl's gdpo with one component).
- ``remax``: G_t = sum_{k >= t} m_k r_k; A_t = (G_t - b_i) m_t, b_i the reward of a greedy response
  to i's prompt (ReMax, Li et al. 2023); returns G. ``reward_baselines`` come from the shards: with
  remax the rollout job decodes one more response per prompt greedily and stores its reward with the
  group (``group/reward_baseline``).
- ``optimal_token_baseline``, ``tir_optimal_token_baseline``: a baseline per token from the
  group's returns at that step (:mod:`hpcrl.trainer.token_baseline`); need ``w_token``.

Deviations from verl, on purpose: a group of one has no baseline, so every group
estimator gives it advantage 0 (verl falls back to the raw score, or raises for
grpo_passk). The config refuses ``rollout.n < 2`` for these estimators anyway. Group means
and stds are computed in float64, so a group of equal scores gets exactly 0: verl's float32
statistics of eight scores of 0.6 give every one of them grpo advantage +0.056 (a rounding
step over a std of 6e-8 + 1e-6), which sharpens the policy on whatever the group sampled.
"""
from __future__ import annotations

from typing import Optional

import torch

from hpcrl.trainer.advantages import AdvantageInputs, masked_whiten
from hpcrl.trainer.token_baseline import optimal_token_baseline

Advantages = tuple[torch.Tensor, torch.Tensor]


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (not whitened) GAE advantages and returns; mask-0 tokens are skipped, not stepped over."""
    B, L = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = token_rewards.new_zeros(B)
    next_adv = token_rewards.new_zeros(B)
    for t in reversed(range(L)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    returns = (adv + values) * mask
    return adv, returns


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """R_t = sum_k gamma^k r_{t+k} over mask-1 steps: GAE with V = 0 and lam = 1."""
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[0]


def _group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """Per-trajectory group mean, unbiased group std (0 for a group of one) and group size, in ``scores``'
    dtype and on its device.

    Computed in float64: the float32 mean of equal scores can miss them by a rounding step (eight 0.6s:
    by 6e-8, with a std of 6e-8 instead of 0), and grpo's division by std + 1e-6 turned that into
    an advantage of +0.056 on every response of the group (verl computes it so): a push towards
    whatever the group sampled. In float64 a sum of up to 2^29 equal float32 scores is exact, so the
    mean is the score itself and the std 0. One scatter per statistic, no loop over groups (each
    iteration of one was a host-device round trip on a GPU)."""
    _, group = torch.unique(group_index, return_inverse=True)
    s = scores.to(torch.float64)
    zeros = s.new_zeros(int(group.max()) + 1 if group.numel() else 0)
    size = zeros.index_add(0, group, torch.ones_like(s))
    mean = zeros.index_add(0, group, s) / size.clamp(min=1)
    dev = s - mean[group]
    var = zeros.index_add(0, group, dev * dev) / (size - 1).clamp(min=1)
    std = torch.where(size > 1, var.sqrt(), zeros)
    return tuple(x[group].to(scores.dtype) for x in (mean, std, size))


def grpo(scores: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """[B] GRPO advantages (zero for a group of one and for a group of equal scores)."""
    mean, std, size = _group_stats(scores, group_index)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(size > 1, adv, torch.zeros_like(adv))


def rloo(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] leave-one-out advantages: s_i minus the mean of the other scores of its group."""
    mean, _, size = _group_stats(scores, group_index)
    n = size.clamp(min=2)
    loo_mean = (mean * n - scores) / (n - 1)
    return torch.where(size > 1, scores - loo_mean, torch.zeros_like(scores))


def opo(scores: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] s_i minus the length-weighted mean score of its group."""
    out = torch.zeros_like(scores)
    for g in torch.unique(group_index):
        sel = group_index == g
        if int(sel.sum()) > 1:
            w = lengths[sel].float()
            out[sel] = scores[sel] - (w * scores[sel]).sum() / w.sum().clamp(min=1e-8)
    return out


def grpo_passk(scores: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool, eps: float = 1e-6
               ) -> torch.Tensor:
    """[B] s_max - s_second on the best trajectory of each group (over its std), 0 elsewhere."""
    out = torch.zeros_like(scores)
    for g in torch.unique(group_index):
        idx = (group_index == g).nonzero().squeeze(1)
        if idx.numel() < 2:
            continue
        s = scores[idx]
        top2 = torch.topk(s, 2).values
        a = top2[0] - top2[1]
        out[idx[torch.argmax(s)]] = a / (s.std(unbiased=True) + eps) if norm_by_std else a
    return out


def gpg(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] alpha (s_i - mean_g s), alpha = B / (trajectories with a non-zero score)."""
    mean, _, size = _group_stats(scores, group_index)
    alpha = scores.numel() / max(int(torch.count_nonzero(scores)), 1)
    return torch.where(size > 1, alpha * (scores - mean), torch.zeros_like(scores))


def gdpo(components: torch.Tensor, group_index: torch.Tensor, steps: torch.Tensor, norm_by_std: bool,
         weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, L] whiten(sum_k c_k grpo(component k)) over ``steps``; ``components`` is [B, K]."""
    c = weights.tolist() if weights is not None else [1.0] * components.shape[1]
    per_traj = sum(c[k] * grpo(components[:, k], group_index, norm_by_std) for k in range(components.shape[1]))
    return masked_whiten(per_traj[:, None] * steps, steps)


def remax(token_rewards: torch.Tensor, steps: torch.Tensor, baselines: torch.Tensor) -> Advantages:
    """(A, G): reward-to-go minus each trajectory's greedy baseline, on ``steps``."""
    returns = (token_rewards * steps).flip(-1).cumsum(-1).flip(-1) * steps
    return (returns - baselines[:, None].float()) * steps, returns


# ---- the registered estimators: one each, x -> (advantages, returns)

def estimate_gae(x: AdvantageInputs) -> Advantages:
    adv, returns = gae(x.token_rewards * x.steps, x.values.float(), x.steps, x.gamma, x.lam)
    return masked_whiten(adv, x.steps), returns


def estimate_reinforce_plus_plus(x: AdvantageInputs) -> Advantages:
    returns = discounted_returns(x.token_rewards * x.steps, x.steps, x.gamma)
    return masked_whiten(returns, x.steps), returns


def estimate_remax(x: AdvantageInputs) -> Advantages:
    return remax(x.token_rewards, x.steps, x.reward_baselines)


def estimate_optimal_token_baseline(x: AdvantageInputs) -> Advantages:
    return optimal_token_baseline(x.token_rewards * x.steps, x.steps, x.group_index, x.w_token, x.is_weights,
                                  multi_turn=False)


def estimate_tir_optimal_token_baseline(x: AdvantageInputs) -> Advantages:
    return optimal_token_baseline(x.token_rewards * x.steps, x.steps, x.group_index, x.w_token, x.is_weights,
                                  multi_turn=True)


def estimate_gdpo(x: AdvantageInputs) -> Advantages:
    adv = gdpo(x.scores[:, None], x.group_index, x.steps, x.norm_by_std)
    return adv, adv


def _per_trajectory(x: AdvantageInputs, per_traj: torch.Tensor) -> Advantages:
    """A per-trajectory advantage on every kept step; the returns are the advantages."""
    adv = per_traj[:, None] * x.steps
    return adv, adv


def estimate_grpo(x: AdvantageInputs) -> Advantages:
    return _per_trajectory(x, grpo(x.scores, x.group_index, x.norm_by_std))


def estimate_rloo(x: AdvantageInputs) -> Advantages:
    return _per_trajectory(x, rloo(x.scores, x.group_index))


def estimate_reinforce_plus_plus_baseline(x: AdvantageInputs) -> Advantages:
    scores = x.scores
    mean, _, size = _group_stats(scores, x.group_index)
    adv, _ = _per_trajectory(x, torch.where(size > 1, scores - mean, torch.zeros_like(scores)))
    adv = masked_whiten(adv, x.steps)
    return adv, adv


def estimate_opo(x: AdvantageInputs) -> Advantages:
    return _per_trajectory(x, opo(x.scores, x.steps.sum(dim=1), x.group_index))


def estimate_grpo_passk(x: AdvantageInputs) -> Advantages:
    return _per_trajectory(x, grpo_passk(x.scores, x.group_index, x.norm_by_std))


def estimate_gpg(x: AdvantageInputs) -> Advantages:
    return _per_trajectory(x, gpg(x.scores, x.group_index))
