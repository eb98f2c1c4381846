"""PF-PPO (``algorithm.use_pf_ppo``, verl's name): resample the local batch by its scores.

After the advantages are computed, the B trajectories of the update are replaced by B draws with
replacement, trajectory i drawn with probability proportional to c_i + 1e-8 (``algorithm.pf_ppo``):

- ``pow``:        c_i = abs(s_i)^weight_pow
- ``max_min``:    c_i = 1 if s_i is the batch's highest or lowest score, else 0
- ``max_random``: c_i = 0.4 if s_i is the highest score, else 0.1

s_i is the trajectory's score (the reward function's, before any KL penalty). verl applies it with
``adv_estimator=gae`` only (the group structure is lost; gae needs none), and so does the config.
The draw is seeded with the optimizer step count, so every trainer rank draws the same rows.
"""
from __future__ import annotations

import torch

from hpcrl.config.names import PF_PPO_REWEIGHT_METHODS


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """[B] unnormalised sampling weights c_i + 1e-8 (module docstring)."""
    s = scores.float()
    if method == "pow":
        c = s.abs().pow(weight_pow)
    elif method == "max_min":
        c = ((s == s.max()) | (s == s.min())).float()
    elif method == "max_random":
        c = torch.where(s == s.max(), 0.4, 0.1)
    else:
        raise ValueError(f"unknown pf_ppo.reweight_method {method!r}; allowed: {', '.join(PF_PPO_REWEIGHT_METHODS)}")
    return torch.clamp(c + 1e-8, min=1e-8)


def pf_ppo_indices(scores: torch.Tensor, method: str, weight_pow: float, seed: int) -> torch.Tensor:
    """[B] row indices drawn with replacement by :func:`pf_ppo_weights`, reproducibly from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(pf_ppo_weights(scores.cpu(), method, weight_pow), len(scores), replacement=True,
                             generator=g).to(scores.device)
