"""The algorithm rules that span config sections: what an estimator, a loss mode or bypass mode
needs from the others. Called by :meth:`hpcrl.config.RunConfig.validate`; each error is one line
naming the key, what is allowed with what, and the fix."""
from __future__ import annotations

from hpcrl.config.checks import fail
from hpcrl.config import registries


def check_algorithm_combinations(cfg) -> None:
    """Raise ConfigError for the first algorithm option that the rest of ``cfg`` (a RunConfig) contradicts."""
    alg, actor = cfg.algorithm, cfg.actor
    est, mode = alg.adv_estimator, actor.policy_loss.loss_mode
    spec = registries.estimator_spec(est)
    if spec is None:
        return  # reported by the section's own check
    if cfg.rollout.n < 2 and spec.group:
        loners = " or ".join(n for n, s in registries.ADV_ESTIMATORS.items() if not s.group)
        fail("rollout.n", cfg.rollout.n, f"at least 2 with adv_estimator={est} (a group of one has no baseline)",
             f"raise rollout.n, or use adv_estimator={loners}")
    if alg.use_pf_ppo and not spec.values:
        critics = " or ".join(n for n, s in registries.ADV_ESTIMATORS.items() if s.values)
        fail("algorithm.use_pf_ppo", True, f"false with adv_estimator={est} (verl resamples only with an estimator "
             f"on a critic's values: {critics})", f"set algorithm.adv_estimator={critics}, or use_pf_ppo=false")
    if mode in ("dppo_tv", "dppo_kl") and actor.clip_ratio_c is None:
        fail("actor.clip_ratio_c", None, f"a number > 1 with loss_mode={mode} (C, the truncation of its "
             "detached ratio)", "e.g. actor.clip_ratio_c=20 (the DPPO paper prefers a large C)")
    _check_rollout_correction(cfg)


def _check_rollout_correction(cfg) -> None:
    rc, k = cfg.algorithm.rollout_correction, "algorithm.rollout_correction."
    if rc.bypass_mode:
        if cfg.uses_prox_log_prob:
            fail(k + "bypass_mode", True, "false while the trainer computes proximal log-probs "
                 "(async_training.compute_prox_log_prob=true or use_rollout_log_probs=false)",
                 "bypass uses the engine's log-probs as the anchor: set compute_prox_log_prob=false and "
                 "use_rollout_log_probs=true, or bypass_mode=false (decoupled)")
        if cfg.actor.policy_loss.loss_mode != "vanilla":
            fail("actor.policy_loss.loss_mode", cfg.actor.policy_loss.loss_mode,
                 "vanilla with bypass_mode=true (verl replaces the loss by bypass mode's loss_type)",
                 "choose the loss with algorithm.rollout_correction.loss_type=ppo_clip|reinforce")
    elif rc.needs_prox and not cfg.uses_prox_log_prob:
        name = next(n for n in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")
                    if getattr(rc, n) is not None)
        fail(k + name, getattr(rc, name),
             "null unless the trainer computes proximal log-probs (the ratio is pi_prox / engine log-probs)",
             "set async_training.compute_prox_log_prob=true, or bypass_mode=true (ratio pi_theta / mu, "
             "computed in the loss)")
