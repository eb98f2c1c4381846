"""Config sections of the RL algorithm (verl's names): ``algorithm`` and ``critic``.

Part of the typed run config (:mod:`hpcrl.config.run` builds, validates and
re-exports them); the equations behind each option are in
``hpcrl/trainer/{advantages,losses,kl,offpolicy}.py`` and docs/algorithms.md.
The loss options of the policy (clip ratios, ``loss_agg_mode``, KL loss, entropy)
live in ``actor`` (:class:`hpcrl.config.ActorConfig`), as in verl.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from hpcrl.config import names, registries
from hpcrl.config.checks import check_choice, check_float, check_int, check_optional_choice, fail
from hpcrl.config.dapo import FilterGroupsConfig


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


def split_rs_options(rollout_rs: str) -> list[str]:
    """``"token_k1, seq_mean_k3"`` -> ``["token_k1", "seq_mean_k3"]`` (duplicates dropped, order kept)."""
    out: list[str] = []
    for part in rollout_rs.split(","):
        if part.strip() and part.strip() not in out:
            out.append(part.strip())
    return out


def rs_thresholds(rollout_rs: str, spec: Union[str, float]) -> dict[str, tuple[Optional[float], float]]:
    """Per ``rollout_rs`` option, its ``(lower, upper)`` bounds from ``rollout_rs_threshold`` (verl 0.9.1's format).

    ``spec`` is one entry shared by every option, or one comma-separated entry per option.
    A ``*_k1`` option bounds a log-ratio statistic by [log lower, log upper]: its entry is
    ``"lower_upper"`` or a number ``upper`` (then lower = 1 / upper). k2 / k3 options take a
    number ``upper`` (lower is None). Raises ValueError naming what is wrong.
    """
    options = split_rs_options(rollout_rs)
    entries = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(entries) == 1:
        entries = entries * len(options)
    if len(entries) != len(options):
        raise ValueError(f"{len(options)} rollout_rs options but {len(entries)} thresholds; give one shared "
                         f"threshold or one per option, comma-separated in the same order")
    out: dict[str, tuple[Optional[float], float]] = {}
    for opt, entry in zip(options, entries):
        if opt.endswith("k1"):
            lo_s, up_s = entry.split("_", 1) if "_" in entry else (None, entry)
        elif "_" in entry:
            raise ValueError(f"{opt} takes one upper bound, got {entry!r} (only *_k1 options take 'lower_upper')")
        else:
            lo_s, up_s = None, entry
        try:
            upper = float(up_s)
            lower = float(lo_s) if lo_s is not None else (1.0 / upper if opt.endswith("k1") and upper > 0 else None)
        except ValueError:
            raise ValueError(f"threshold {entry!r} of {opt} is not a number (or 'lower_upper' for *_k1)") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"threshold {entry!r} of {opt}: bounds must satisfy 0 < lower <= upper")
        out[opt] = (lower, upper)
    return out


def is_bounds(spec: Union[str, float]) -> tuple[Optional[float], float]:
    """``rollout_is_threshold`` -> ``(lower, upper)``: a number C is truncation (lower None); a string
    ``"lower_upper"`` is IcePop (weights outside [lower, upper] become 0), verl 0.9.1's format.
    Raises ValueError naming what is wrong."""
    if isinstance(spec, bool):
        raise ValueError("a number or a \"lower_upper\" string, not a boolean")
    text = str(spec).strip()
    lo_s, up_s = text.split("_", 1) if isinstance(spec, str) and "_" in text else (None, text)
    try:
        upper, lower = float(up_s), (float(lo_s) if lo_s is not None else None)
    except ValueError:
        raise ValueError(f"{spec!r} is neither a number nor \"lower_upper\" (e.g. \"0.5_5.0\")") from None
    if lower is None and upper < 1.0:
        raise ValueError("a number >= 1.0 (the truncation C) or \"lower_upper\" (IcePop)")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"IcePop bounds {spec!r} must satisfy 0 < lower <= upper")
    return lower, upper


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the engine's (behaviour, mu) and the trainer's proximal
    (pi_prox) log-probs, with verl 0.9.1's option strings and meaning; rho = pi_prox / mu.
    Equations in ``hpcrl/trainer/offpolicy.py`` and docs/algorithms.md."""

    rollout_is: Optional[str] = None
    """Truncated importance weights min(rho, C) on the policy loss: ``token``,
    ``sequence`` (product over the sequence), or null (off). Needs the proximal
    log-probs (async_training.compute_prox_log_prob=true or use_rollout_log_probs=false)."""
    rollout_is_threshold: Union[float, str] = 2.0
    """A number C: truncated IS, w = min(rho, C) (C >= 1). A string ``"lower_upper"`` (quote it in YAML):
    IcePop, w = rho inside [lower, upper] and 0 outside (verl 0.9.1's format)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the local batch (tokens for ``token``,
    sequences for ``sequence``) so that they average 1."""
    rollout_rs: Optional[str] = None
    """Rejection (mask out) by a divergence statistic of log rho, verl 0.9.1's options (one, or
    several comma-separated, all must keep a token): ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``
    (bounds on -log rho: keep lower <= 1/rho, prod(1/rho), geo-mean(1/rho) <= upper);
    ``token_k2/k3``, ``seq_sum_k2/k3``, ``seq_mean_k2/k3``, ``seq_max_k2/k3`` (keep k <= upper).
    verl 0.6's ``token``, ``sequence``, ``geometric`` are refused with their replacement."""
    rollout_rs_threshold: Optional[Union[str, float]] = None
    """Bounds of rollout_rs (required with it): one entry, or one per option, comma-separated.
    ``*_k1``: ``"lower_upper"`` (quote it in YAML) or a number upper (lower = 1/upper), bounds on
    1/rho = mu / pi_prox; k2 / k3: a number, the upper bound."""
    rollout_rs_threshold_lower: Optional[float] = None
    """Retired (verl 0.6's separate lower bound; must be null): write both bounds as
    rollout_rs_threshold: "lower_upper"."""
    rollout_token_veto_threshold: Optional[float] = None
    """Reject a whole sequence if any of its tokens has rho below this (null = off; verl 0.6's knob)."""
    max_token_lag: Optional[int] = None
    """Mask tokens sampled more than this many weight versions before the trainer's
    version (per-token lag from the shards' token_versions; null = off)."""
    bypass_mode: bool = False
    """verl 0.9.1's bypass mode: the engine's log-probs mu are the PPO anchor (no proximal forward,
    async_training.compute_prox_log_prob=false) and rollout_is / rollout_rs are computed in the loss,
    per micro-batch, from pi_theta / mu with the current weights (no gradient through them).
    false (decoupled): they use pi_prox / mu, and need the proximal log-probs."""
    loss_type: str = "ppo_clip"
    """With bypass_mode: ``ppo_clip`` (PPO clip on pi_theta / mu, rejection applied, IS weights only
    logged: the ratio already corrects) or ``reinforce`` (l = -A w log pi_theta with the IS weights;
    no clip). Must stay ppo_clip without bypass_mode (verl ignores it there)."""
    mask_before_advantages: bool = True
    """Where the rejection, veto and lag masks act. true (verl's behaviour): they replace the
    response mask before advantages and critic targets, so rejected tokens are no steps, take no
    part in whitening and train neither policy nor critic. false: they mask only the actor's
    losses (policy, entropy, KL); advantages and the critic see every token."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        k = "algorithm.rollout_correction."
        check_optional_choice(k + "rollout_is", self.rollout_is, names.IS_LEVELS)
        try:
            is_bounds(self.rollout_is_threshold)
        except ValueError as e:
            fail(k + "rollout_is_threshold", self.rollout_is_threshold, str(e),
                "e.g. 2.0 (truncation) or \"0.5_5.0\" (IcePop)")
        check_choice(k + "rollout_is_batch_normalize", self.rollout_is_batch_normalize, (True, False))
        check_choice(k + "mask_before_advantages", self.mask_before_advantages, (True, False))
        if self.rollout_rs_threshold_lower is not None:
            fail(k + "rollout_rs_threshold_lower", self.rollout_rs_threshold_lower,
                 "null (retired with verl 0.6's rollout_rs levels)",
                 "give both bounds as rollout_rs_threshold: \"lower_upper\" (bounds on 1/rho for *_k1 options)")
        if self.rollout_rs is not None:
            self._validate_rs(k)
        elif self.rollout_rs_threshold is not None:
            fail(k + "rollout_rs_threshold", self.rollout_rs_threshold, "null without rollout_rs",
                 "set rollout_rs (e.g. seq_mean_k1) or remove rollout_rs_threshold")
        if self.rollout_token_veto_threshold is not None:
            check_float(k + "rollout_token_veto_threshold", self.rollout_token_veto_threshold, 0.0, 1.0, lo_open=True)
        if self.max_token_lag is not None:
            check_int(k + "max_token_lag", self.max_token_lag, 0)
        check_choice(k + "bypass_mode", self.bypass_mode, (True, False))
        check_choice(k + "loss_type", self.loss_type, names.BYPASS_LOSS_TYPES)
        if not self.bypass_mode and self.loss_type != "ppo_clip":
            fail(k + "loss_type", self.loss_type, "ppo_clip unless bypass_mode=true (it picks bypass mode's loss)",
                 "set algorithm.rollout_correction.bypass_mode=true, or remove loss_type")
        if self.bypass_mode and self.rollout_token_veto_threshold is not None:
            fail(k + "rollout_token_veto_threshold", self.rollout_token_veto_threshold,
                 "null with bypass_mode=true (verl 0.9.1's bypass mode has no veto)",
                 "use rollout_rs (e.g. token_k1 with \"lower_upper\") or bypass_mode=false")

    def _validate_rs(self, k: str) -> None:
        options = split_rs_options(self.rollout_rs) if isinstance(self.rollout_rs, str) else []
        retired = [opt for opt in options if opt in names.RS_RETIRED]
        if retired:
            return fail(k + "rollout_rs", self.rollout_rs, "verl 0.9.1's options: " + ", ".join(names.RS_OPTIONS),
                        f"{retired[0]!r} is verl 0.6's name: use {names.RS_RETIRED[retired[0]]!r} with "
                        f"rollout_rs_threshold \"lower_upper\", whose bounds apply to 1/rho (old bounds [a, b] on rho "
                        f"become \"1/b_1/a\"); see the rollout-correction table in docs/algorithms.md")
        if not options or any(opt not in names.RS_OPTIONS for opt in options):
            return fail(k + "rollout_rs", self.rollout_rs,
                        "null or comma-separated options of " + ", ".join(names.RS_OPTIONS))
        if self.rollout_rs_threshold is None:
            return fail(k + "rollout_rs_threshold", None, "bounds for rollout_rs (verl 0.9.1 requires them)",
                        "e.g. rollout_rs_threshold: \"0.5_2.0\" for *_k1, 0.01 for k2/k3")
        try:
            rs_thresholds(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as e:
            fail(k + "rollout_rs_threshold", self.rollout_rs_threshold, str(e))

    @property
    def needs_prox(self) -> bool:
        """IS weights or rejection against pi_prox: the trainer must compute proximal log-probs."""
        return not self.bypass_mode and any(v is not None for v in (self.rollout_is, self.rollout_rs,
                                                                    self.rollout_token_veto_threshold))


@dataclass
class PolicyLossConfig:
    """``actor.policy_loss`` (verl's ``PolicyLossConfig``): which policy loss, and the knobs of
    the covariance-based ones. Equations in ``hpcrl/trainer/policy_losses.py`` and docs/algorithms.md."""

    loss_mode: str = "vanilla"
    """``vanilla`` (PPO clip + dual clip), ``gspo`` (sequence-level geometric-mean ratio), ``cispo``
    (clipped, detached ratio times log-prob), ``gpg`` (-A log pi), ``clip_cov``, ``kl_cov``,
    ``geo_mean`` (GMPO), ``dppo_tv`` / ``dppo_kl`` (DPPO: a probability-divergence trust region),
    ``sapo`` (smooth gate instead of a clip), ``dro`` (quadratic log-ratio penalty)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of a micro-batch's tokens (at least one) whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens with covariance strictly above this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and strictly below this."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of a micro-batch's tokens (at least one), the largest covariances, that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the abs(log-ratio) penalty on those tokens."""
    dro_beta: Optional[float] = None
    """dro: beta of the penalty beta/2 (log pi_theta - log pi_old)^2 (required, > 0, with loss_mode=dro)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        k = "actor.policy_loss."
        if self.loss_mode == "bypass_mode":
            fail(k + "loss_mode", self.loss_mode, "one of " + ", ".join(registries.POLICY_LOSS_MODES),
                 "verl sets bypass_mode itself: set algorithm.rollout_correction.bypass_mode=true (and loss_type)")
        check_choice(k + "loss_mode", self.loss_mode, registries.POLICY_LOSS_MODES)
        check_float(k + "clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0, lo_open=True)
        check_float(k + "clip_cov_lb", self.clip_cov_lb, -math.inf)
        if not self.clip_cov_ub > self.clip_cov_lb:
            fail(k + "clip_cov_ub", self.clip_cov_ub, f"a number > clip_cov_lb = {self.clip_cov_lb}")
        check_float(k + "kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0, lo_open=True)
        check_float(k + "ppo_kl_coef", self.ppo_kl_coef, 0.0)
        if self.dro_beta is not None:
            check_float(k + "dro_beta", self.dro_beta, 0.0, lo_open=True)
        elif self.loss_mode == "dro":
            fail(k + "dro_beta", None, "a number > 0 with loss_mode=dro (verl 0.9.1 has no default)",
                 "e.g. actor.policy_loss.dro_beta=0.1")


@dataclass
class PfPpoConfig:
    """``algorithm.pf_ppo``: how PF-PPO resamples the batch (``use_pf_ppo``; verl's keys)."""

    reweight_method: str = "pow"
    """Sampling weight of trajectory i from its score s_i: ``pow`` abs(s_i)^weight_pow, ``max_min``
    1 for the batch's highest and lowest scores and 0 otherwise, ``max_random`` 0.4 for the highest
    score, 0.1 otherwise (each + 1e-8)."""
    weight_pow: float = 2.0
    """The power of ``pow``."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("algorithm.pf_ppo.reweight_method", self.reweight_method, names.PF_PPO_REWEIGHT_METHODS)
        check_float("algorithm.pf_ppo.weight_pow", self.weight_pow, 0.0)


@dataclass
class AlgorithmConfig:
    """``algorithm``: advantage estimator, KL in the reward, rollout correction (verl's names)."""

    adv_estimator: str = "grpo"
    """Advantage estimator (verl's names): a name of ``config/registries.py:ADV_ESTIMATORS`` (the reference lists
    each with what it is). Equations in ``hpcrl/trainer/estimators.py`` and docs/algorithms.md."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo, grpo_passk: divide by the group's reward std (+1e-6); false = Dr. GRPO (mean only)."""
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
    use_pf_ppo: bool = False
    """PF-PPO (verl's name): after the advantages, resample the local batch's trajectories with
    replacement by ``pf_ppo``'s weights of their scores. verl applies it with ``gae`` only, so the
    config refuses it with other estimators."""
    pf_ppo: PfPpoConfig = field(default_factory=PfPpoConfig)
    """PF-PPO's sampling weights."""
    gdpo_reward_keys: Optional[list] = None
    """gdpo: names of reward components to normalise separately (verl). Must be null: a shard holds
    one reward per trajectory, so gdpo normalises that one (see docs/algorithms.md)."""
    gdpo_reward_weights: Optional[list] = None
    """gdpo: a weight per reward component (null = equal). Must be null with gdpo_reward_keys null."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling: groups whose metric does not vary are dropped before an update (verl's keys;
    hpcrl/config/dapo.py)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("algorithm.adv_estimator", self.adv_estimator, registries.ADV_ESTIMATORS)
        check_choice("algorithm.norm_adv_by_std_in_grpo", self.norm_adv_by_std_in_grpo, (True, False))
        check_float("algorithm.gamma", self.gamma, 0.0, 1.0)
        check_float("algorithm.lam", self.lam, 0.0, 1.0)
        check_choice("algorithm.use_kl_in_reward", self.use_kl_in_reward, (True, False))
        check_choice("algorithm.kl_penalty", self.kl_penalty, names.KL_ESTIMATORS)
        self.kl_ctrl.validate()
        self.rollout_correction.validate()
        check_choice("algorithm.use_pf_ppo", self.use_pf_ppo, (True, False))
        self.pf_ppo.validate()
        self.filter_groups.validate()
        if self.gdpo_reward_keys is not None:
            fail("algorithm.gdpo_reward_keys", self.gdpo_reward_keys,
                 "null (a shard holds one reward per trajectory; per-component rewards need a shard field)",
                 "return the weighted sum of the components as the score, or use adv_estimator=grpo")
        if self.gdpo_reward_weights is not None:
            fail("algorithm.gdpo_reward_weights", self.gdpo_reward_weights, "null while gdpo_reward_keys is null",
                 "remove gdpo_reward_weights")


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
