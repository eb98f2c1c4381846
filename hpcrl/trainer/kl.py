"""KL to the frozen reference policy: per-token estimators and the reward-KL controllers.

Samples are drawn from the policy pi, so per sampled token, with
``x = log pi(y_t) - log ref(y_t)`` (J. Schulman, "Approximating KL divergence", 2020):

- ``k1`` (``kl``):          x                       unbiased for KL(pi || ref); can be negative
- ``k2`` (``mse``):         x^2 / 2                 biased, low variance, >= 0
- ``k3`` (``low_var_kl``):  exp(-x) - 1 + x         unbiased, >= 0 (e^u >= 1 + u)
- ``abs``:                  |x|

As verl does, k3 clamps ``-x`` to [-20, 20] and the result to at most 10 for
numerical safety (it stays >= 0).

**Straight-through forms** (verl 0.9.1): a name ending in ``+`` (``kl+``, ``k1+``, ``abs+``,
``low_var_kl+``, ``k3+``; ``mse+``/``k2+`` equal k2) has the value of its base estimator and the
gradient of k2, ``x^2 / 2``: ``k2(x) - sg(k2(x)) + sg(base(x))``. k1 and k3 are unbiased for the
KL's value but their expected gradient is not the KL's gradient; k2's is. In the reward (no
gradient) a ``+`` form equals its base.

Where the KL goes (verl's switches):

- ``algorithm.use_kl_in_reward``: token reward r_t <- r_t - beta * kl_t with
  ``algorithm.kl_penalty``, pi = the PPO anchor (see ``hpcrl/trainer/update.py``);
  beta comes from ``algorithm.kl_ctrl``: fixed, or adaptive (Ziegler et al. 2019):
  after each local update, beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n / horizon),
  with KL the batch mean of the per-sequence token-mean kl and n the number of sequences.
- ``actor.use_kl_loss``: loss += kl_loss_coef * agg(kl(pi_theta, ref)) with ``actor.kl_loss_type``.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcrl.config.names import KL_CTRL_TYPES, KL_ESTIMATORS  # the allowed names live with the config


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || ref) from the sampled tokens' log-probs (a ``+`` form:
    the base estimator's value with k2's gradient)."""
    if kind.endswith("+") and kind in KL_ESTIMATORS:
        value = _forward(logp, ref_logp, kind[:-1]).detach()
        k2 = 0.5 * (logp - ref_logp).square()
        return k2 - k2.detach() + value
    return _forward(logp, ref_logp, kind)


def _forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        neg = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, max=10.0)
    if kind == "abs":
        return (logp - ref_logp).abs()
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")


class FixedKLController:
    """beta stays at ``kl_coef``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller driving the measured KL towards ``target_kl`` over ``horizon`` samples."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


def make_controller(kl_ctrl) -> FixedKLController | AdaptiveKLController:
    """From ``algorithm.kl_ctrl`` (:class:`hpcrl.config.KLControlConfig`)."""
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kl_ctrl.type!r}; allowed: {', '.join(KL_CTRL_TYPES)}")


def apply_kl_in_reward(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                       kind: str, controller) -> tuple[torch.Tensor, dict]:
    """r_t - beta * kl_t on mask-1 tokens; then the controller sees this batch's KL."""
    m = mask.float()
    kl = kl_estimate(logp, ref_logp, kind) * m
    beta = controller.value
    per_seq = kl.sum(1) / m.sum(1).clamp(min=1)
    has = m.sum(1) > 0
    current_kl = float(per_seq[has].mean()) if bool(has.any()) else 0.0
    controller.update(current_kl, int(has.sum()))
    stats = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_rewards - beta * kl, stats
