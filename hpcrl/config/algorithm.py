"""Config sections of the RL algorithm (verl's names): ``algorithm`` and ``critic``.

Part of the typed run config (:mod:`hpcrl.config.run` builds, validates and
re-exports them); the equations behind each option are in
``hpcrl/trainer/{advantages,losses,kl,offpolicy}.py`` and the README.
The loss options of the policy (clip ratios, ``loss_agg_mode``, KL loss, entropy)
live in ``actor`` (:class:`hpcrl.config.ActorConfig`), as in verl.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hpcrl.config import names
from hpcrl.config.checks import check_choice, check_float, check_int, check_optional_choice


@dataclass
class KLControlConfig:
    """``algorithm.kl_ctrl``: the coefficient of the KL penalty in the reward."""

    type: str = "fixed"
    """Controller of the reward-KL coefficient beta: ``fixed`` (beta = kl_coef) or
    ``adaptive`` (beta *= 1 + clip(KL / target_kl - 1, -0.2, 0.2) * n / horizon after
    every local update, n = sequences in it)."""
    kl_coef: float = 0.001
    """beta (initial beta for ``adaptive``)."""
    horizon: int = 10000
    """Adaptive controller: samples over which beta moves by at most +-20%."""
    target_kl: float = 0.1
    """Adaptive controller: the KL (nats per token) beta steers towards."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("algorithm.kl_ctrl.type", self.type, names.KL_CTRL_TYPES)
        check_float("algorithm.kl_ctrl.kl_coef", self.kl_coef, 0.0)
        check_int("algorithm.kl_ctrl.horizon", self.horizon, 1)
        check_float("algorithm.kl_ctrl.target_kl", self.target_kl, 0.0, lo_open=True)


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the engine's (behaviour) and the trainer's
    proximal log-probs; equations in ``hpcrl/trainer/offpolicy.py`` and the README."""

    rollout_is: Optional[str] = None
    """Truncated importance weights min(pi_prox / mu, C) on the PPO loss: ``token``,
    ``sequence`` (product over the sequence), or null (off). Needs the proximal
    log-probs (async_training.compute_prox_log_prob=true or use_rollout_log_probs=false)."""
    rollout_is_threshold: float = 2.0
    """C, the truncation threshold of the importance weights."""
    rollout_rs: Optional[str] = None
    """Rejection: mask out of the loss what has pi_prox / mu outside [lower, upper]:
    ``token``, ``sequence`` (product), ``geometric`` (geometric mean over the sequence), or null."""
    rollout_rs_threshold: Optional[float] = None
    """Upper bound of the rejection ratio (null = rollout_is_threshold)."""
    rollout_rs_threshold_lower: Optional[float] = None
    """Lower bound of the rejection ratio (null = 1 / upper)."""
    rollout_token_veto_threshold: Optional[float] = None
    """Reject a whole sequence if any of its tokens has pi_prox / mu below this (null = off)."""
    max_token_lag: Optional[int] = None
    """Mask tokens sampled more than this many weight versions before the trainer's
    version (per-token lag from the shards' token_versions; null = off)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        k = "algorithm.rollout_correction."
        check_optional_choice(k + "rollout_is", self.rollout_is, names.IS_LEVELS)
        check_float(k + "rollout_is_threshold", self.rollout_is_threshold, 1.0)
        check_optional_choice(k + "rollout_rs", self.rollout_rs, names.RS_LEVELS)
        if self.rollout_rs_threshold is not None:
            check_float(k + "rollout_rs_threshold", self.rollout_rs_threshold, 1.0)
        if self.rollout_rs_threshold_lower is not None:
            upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
            check_float(k + "rollout_rs_threshold_lower", self.rollout_rs_threshold_lower, 0.0, upper)
        if self.rollout_token_veto_threshold is not None:
            check_float(k + "rollout_token_veto_threshold", self.rollout_token_veto_threshold, 0.0, 1.0, lo_open=True)
        if self.max_token_lag is not None:
            check_int(k + "max_token_lag", self.max_token_lag, 0)

    @property
    def needs_prox(self) -> bool:
        return any(v is not None for v in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))


@dataclass
class AlgorithmConfig:
    """``algorithm``: advantage estimator, KL in the reward, rollout correction (verl's names)."""

    adv_estimator: str = "grpo"
    """Advantage estimator (verl's names): ``gae`` (critic = value head), ``grpo``,
    ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``. Equations in
    ``hpcrl/trainer/advantages.py`` and the README."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo: divide by the group's reward std (+1e-6); false = Dr. GRPO (mean only)."""
    gamma: float = 1.0
    """Discount per response token (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae only): 1 = Monte-Carlo return minus value, 0 = one-step TD."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(anchor || reference) from every token's reward (needs the reference model)."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty: ``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``, ``abs``."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """beta of the reward penalty: fixed or adaptive."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection masks for stale / mismatched samples."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("algorithm.adv_estimator", self.adv_estimator, names.ADV_ESTIMATORS)
        check_choice("algorithm.norm_adv_by_std_in_grpo", self.norm_adv_by_std_in_grpo, (True, False))
        check_float("algorithm.gamma", self.gamma, 0.0, 1.0)
        check_float("algorithm.lam", self.lam, 0.0, 1.0)
        check_choice("algorithm.use_kl_in_reward", self.use_kl_in_reward, (True, False))
        check_choice("algorithm.kl_penalty", self.kl_penalty, names.KL_ESTIMATORS)
        self.kl_ctrl.validate()
        self.rollout_correction.validate()


@dataclass
class CriticConfig:
    """The critic of ``algorithm.adv_estimator=gae``: a value head on the policy's last
    hidden state, trained in the same DeepSpeed engine (see hpcrl/trainer/models.py)."""

    lr: float = 1e-3
    """Adam learning rate of the value head (its own parameter group; the shared trunk
    moves with actor.lr). On the tiny model 1e-2 made the values oscillate around
    the returns; 1e-3 tracks them."""
    cliprange_value: float = 0.5
    """Value clip c_v: the new value may move at most c_v from the value at the start of the update."""
    vf_coef: float = 1.0
    """Weight of the value loss in the engine's total loss (the trunk is shared with the policy)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_float("critic.lr", self.lr, 0.0, lo_open=True)
        check_float("critic.cliprange_value", self.cliprange_value, 0.0, lo_open=True)
        check_float("critic.vf_coef", self.vf_coef, 0.0, lo_open=True)
