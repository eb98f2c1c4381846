"""The seam of the advantage estimators: :func:`compute_advantages` runs the one ``algorithm.adv_estimator`` names.

Each estimator is one function, ``fn(x: AdvantageInputs) -> (advantages, returns)`` (both ``[B, L]``, zero where
``mask`` is 0), and one entry in :data:`hpcrl.config.registries.ADV_ESTIMATORS` (an ``EstimatorSpec``) that
declares what it needs beyond the rewards and masks: the critic's values (the trainer then adds a value head and
trains it), the trainer's score norms of the sampled tokens (computed at the start of the update), one greedy
response per prompt (the rollout job decodes it and stores its reward with the group), the rest of the group as
its baseline (``rollout.n >= 2``). The trainer, the rollout job and the config's checks read those needs, never an
estimator's name; a new estimator is a module with its function and one registry entry. The built-in ones and
their equations: :mod:`hpcrl.trainer.estimators`.

Inputs are padded ``[B, L]`` tensors over response tokens: ``token_rewards`` (the trajectory's score on its last
mask-1 token, minus a per-token KL penalty when ``use_kl_in_reward``), ``mask`` (1 = model token that is trained,
0 = tool/env token or padding), ``steps`` (``mask`` without the tokens ``keep`` rejects) and ``group_index[i]``,
the group (prompt) trajectory ``i`` belongs to.

``keep`` (the rejection / lag mask, with ``rollout_correction.mask_before_advantages``) removes tokens as verl's
rejection does: token-level estimators (gae, reinforce_plus_plus) skip them as steps (a rejected last token takes
its reward with it), whitening and opo's lengths count only kept tokens, and every advantage is 0 on them. The
trajectory scores s_i (:attr:`AdvantageInputs.scores`), and so the group statistics, are unchanged: a rejected
trajectory still tells its group how good the others were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hpcrl.config.registries import ADV_ESTIMATORS, resolve


@dataclass
class AdvantageInputs:
    """What every estimator is called with (module docstring); the optional fields are there when its spec asks."""

    token_rewards: torch.Tensor
    """[B, L] rewards on mask-1 tokens (0 elsewhere)."""
    mask: torch.Tensor
    """[B, L] float: 1 = a model token that is trained."""
    steps: torch.Tensor
    """[B, L] float: ``mask`` without the tokens ``keep`` rejects (the steps token-level estimators take)."""
    group_index: torch.Tensor
    """[B] the group (prompt) of each trajectory."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    """``algorithm.norm_adv_by_std_in_grpo``."""
    values: Optional[torch.Tensor] = None
    """[B, L] the critic's values at the start of the update (``EstimatorSpec.values``)."""
    w_token: Optional[torch.Tensor] = None
    """[B, L] the trainer's score norms of the sampled tokens (``EstimatorSpec.score_norms``)."""
    is_weights: Optional[torch.Tensor] = None
    """[B, L] importance weights, when the rollout correction computes them."""
    reward_baselines: Optional[torch.Tensor] = None
    """[B] the reward of one greedy response to each trajectory's prompt (``EstimatorSpec.greedy_baseline``)."""

    @property
    def scores(self) -> torch.Tensor:
        """[B] each trajectory's score s_i, over all of its model tokens (rejected ones included)."""
        return self.token_rewards.sum(dim=1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over mask-1 entries (unbiased var); mask-0 entries are 0."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def place_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, L] token rewards: the score sits on each row's last mask-1 token
    (a row without one gets no reward: nothing of it is trained)."""
    B, L = mask.shape
    out = torch.zeros(B, L, dtype=torch.float32, device=mask.device)
    pos = torch.arange(L, device=mask.device).expand(B, L)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(dim=1).values
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = scores[has].float()
    return out


def compute_advantages(estimator: str, token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor,
                       *, values: Optional[torch.Tensor] = None, gamma: float = 1.0, lam: float = 1.0,
                       norm_adv_by_std_in_grpo: bool = True, keep: Optional[torch.Tensor] = None,
                       w_token: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
                       reward_baselines: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of the estimator ``algorithm.adv_estimator`` names (module docstring). ``values``:
    the critic's; ``w_token``: the score norms; ``is_weights``: importance weights (optional); ``reward_baselines``:
    the greedy rewards, one per trajectory. ValueError for an unknown name, or an input its spec needs that is
    missing."""
    spec = ADV_ESTIMATORS.get(estimator)
    if spec is None:
        raise ValueError(f"unknown advantage estimator {estimator!r}; allowed: {', '.join(ADV_ESTIMATORS)}")
    needs = {"values from the critic": spec.values and values is None,
             "w_token (the trainer's score norms of the sampled tokens)": spec.score_norms and w_token is None,
             "reward_baselines, the reward of a greedy response per prompt: a group of this batch has no "
             "group/reward_baseline (its shard was written by a rollout job whose estimator needs none)":
                 spec.greedy_baseline and reward_baselines is None}
    missing = [what for what, gone in needs.items() if gone]
    if missing:
        raise ValueError(f"{estimator} needs {'; and '.join(missing)}")
    mask = mask.float()
    x = AdvantageInputs(token_rewards * mask, mask, mask * keep.float() if keep is not None else mask, group_index,
                        gamma, lam, norm_adv_by_std_in_grpo, values, w_token, is_weights, reward_baselines)
    return resolve(spec.fn)(x)
