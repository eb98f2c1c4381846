"""One local update of the policy (and critic) on a batch of R groups.

:meth:`PolicyUpdate.run` does, in order:

1. **precompute** under ``no_grad``, with the weights at the start of this
   update (before its first optimizer step), each rank its share of the rows in chunks of
   ``actor.log_prob_max_token_len_per_gpu`` tokens (or of ``ppo_micro_batch_size`` groups), summed across ranks:
   the proximal log-probs ``prox_logp`` (when ``compute_prox_log_prob`` or
   ``use_rollout_log_probs=false``), the critic's ``old_values`` and the score norms ``w_token`` (when the
   estimator's spec needs them: ``config/registries.py:ADV_ESTIMATORS``), and the
   frozen reference model's ``ref_logp`` (when a KL term is on);
2. **anchor**: ``logp_old = prox_logp`` if computed, else the engine's
   ``behav_logp`` (bypass: the engine's policy is the PPO anchor);
3. **correct**: importance weights pi_prox / mu, rejection and lag masks
   (:mod:`hpcrl.trainer.offpolicy`) -> ``is_weights``, ``loss_mask``, and ``adv_mask``
   (= ``loss_mask`` with ``rollout_correction.mask_before_advantages``, else the response mask);
   in ``bypass_mode`` only the lag mask here: weights and rejection come per micro-batch in step 6;
   with ``actor.overlong_filter`` (DAPO's overlong filtering) the truncated responses then leave ``loss_mask``
   only: their rewards still make their groups' baselines, advantages and the critic see them;
4. **rewards**: the score on each trajectory's last model token, minus
   beta * KL(anchor || reference) per token with ``use_kl_in_reward``
   (then the KL controller updates beta);
5. **advantages** (and returns) with ``algorithm.adv_estimator`` over ``adv_mask``; with
   ``use_pf_ppo`` the batch's rows are then resampled by their scores (:mod:`hpcrl.trainer.pf_ppo`);
6. **train**: ``ppo_epochs`` passes over ``require_batches`` mini-batches; each rank runs its micro-batches of
   each (by tokens with ``actor.use_dynamic_bsz``, else by groups: :mod:`hpcrl.trainer.packing`; the rows packed
   without padding for the model: :mod:`hpcrl.trainer.forward`); per micro-batch: policy loss
   (``actor.policy_loss.loss_mode``, IS weights) - entropy bonus + KL loss + value loss (over ``adv_mask``),
   ``engine.backward``; DeepSpeed
   steps (and clips the gradient norm) once per mini-batch. In ``bypass_mode`` (verl 0.9.1) the
   micro-batch's IS weights and rejection mask are computed first from pi_theta / mu (detached, the
   current weights), as verl's bypass loss does: ``loss_type=ppo_clip`` is vanilla PPO on the
   rejection-masked tokens (weights only logged), ``reinforce`` is -A w log pi (``gpg``); rejected
   tokens stay in the denominators, as in verl.

Per-token versions are in ``batch.token_versions`` / ``batch.token_lag``; the
built-in use is ``rollout_correction.max_token_lag``, and any other lag
weighting is one line in :meth:`PolicyUpdate.prepare` (see docs/algorithms.md).
"""
from __future__ import annotations

import torch

from hpcrl.config.registries import estimator_spec
from hpcrl.trainer import offpolicy
from hpcrl.trainer.advantages import compute_advantages, masked_mean, place_scores
from hpcrl.trainer.batch import Batch, stand_in
from hpcrl.trainer.forward import Layout, run_model
from hpcrl.trainer.kl import apply_kl_in_reward, kl_estimate, make_controller
from hpcrl.trainer.losses import agg_counts, agg_loss, value_loss
from hpcrl.trainer.packing import micro_batches
from hpcrl.trainer.pf_ppo import pf_ppo_indices
from hpcrl.trainer.policy_losses import LossParams, policy_loss

TRUNCATED_SHARE = "response_length/clip_ratio"
"""verl's name of the share of responses that hit the length limit (here: of the update's, overlong filtering on)."""


def overlong_filter(batch: Batch) -> tuple[torch.Tensor, float]:
    """DAPO's overlong filtering: ``loss_mask`` without the tokens of truncated responses, and their share. A new
    tensor: ``adv_mask`` (which may be the same one) keeps them."""
    if batch.truncated is None:
        raise ValueError("actor.overlong_filter needs traj/truncated, whether each response hit "
                         "rollout.response_length: a group of this batch has none (its shard was written by a rollout "
                         "job without overlong filtering)")
    keep = (1.0 - batch.truncated).to(batch.loss_mask.dtype).unsqueeze(-1)
    return batch.loss_mask * keep, float(batch.truncated.mean())


def step_with_grad_norm(engine, last_norm: float) -> float:
    """``engine.step()``; returns the global gradient norm *before* clipping if this was an
    optimizer step, else ``last_norm``. DeepSpeed reports the norm for ZeRO >= 1 and bf16;
    with ZeRO 0 in fp32 it clips with torch and drops the norm, so it is measured here."""
    if not engine.is_gradient_accumulation_boundary():
        engine.step()
        return last_norm
    norm = None
    if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    engine.step()
    return norm if norm is not None else float(engine.get_global_grad_norm() or 0.0)


class PolicyUpdate:
    """One local update as named steps (see the module docstring): log-probs, corrections, advantages, optimizer steps."""

    def __init__(self, cfg, engine, layout: Layout, reference=None, kl_coef=None, rank: int = 0, world: int = 1):
        self.cfg = cfg
        self.engine = engine
        self.layout = layout
        self.rank, self.world = rank, world
        self.reference = reference
        self.kl_ctrl = make_controller(cfg.algorithm.kl_ctrl)
        if kl_coef is not None:  # restored from a checkpoint (the adaptive controller's state)
            self.kl_ctrl.value = float(kl_coef)

    @property
    def kl_coef(self) -> float:
        return self.kl_ctrl.value

    def run(self, batch: Batch) -> dict:
        """One local update on ``batch`` (kept on the CPU: each micro-batch goes to the device on its own)."""
        # of the batch as sampled (PF-PPO resamples its rows in prepare)
        sampled = {"reward/mean": float(batch.rewards.mean()),
                   "reward/std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
                   "response_length/mean": float(batch.mask.sum(1).mean()), "n_tokens": batch.n_tokens}
        stats = self.prepare(batch)
        stats.update(self.train(batch))
        stats.update(sampled)
        return stats

    # ---- steps 1-5
    def _mine(self, batch: Batch, budget_tokens) -> list[list[int]]:
        """This rank's micro-batches of ``batch``'s rows: by tokens (``budget_tokens`` per GPU) with
        ``actor.use_dynamic_bsz``, else ``actor.ppo_micro_batch_size`` groups each (hpcrl/trainer/packing.py); the
        ranks of a sequence-parallel group share theirs (sequence_parallel.py)."""
        return self._plan(batch, budget_tokens)[self.rank // self.layout.sp]

    def _plan(self, batch: Batch, budget_tokens) -> list[list[list[int]]]:
        """Per data-parallel rank (world / sp of them), its micro-batches (:meth:`_mine`)."""
        actor, sp = self.cfg.actor, self.layout.sp
        return micro_batches(batch.seq_lens.tolist(), self.world // sp,
                             budget_tokens=budget_tokens * sp if actor.use_dynamic_bsz else None,
                             rows_per_micro=actor.ppo_micro_batch_size * self.cfg.rollout.n)

    def _micro(self, batch: Batch, rows: list[int]) -> Batch:
        """The rows on this rank's device; no rows: a stand-in whose masks are 0 (packing.py: every rank runs as
        many micro-batches as the others)."""
        micro = batch.select(rows) if rows else stand_in(batch, self.layout.pad_id)
        return micro.to(self.engine.device)

    @torch.no_grad()
    def _precompute(self, batch: Batch) -> None:
        """Step 1 on every rank: each computes its share of the rows (``actor.log_prob_max_token_len_per_gpu``
        tokens per forward, or micro-batches of groups) and the shares are summed across ranks."""
        cfg = self.cfg
        needs = estimator_spec(cfg.algorithm.adv_estimator)  # what the estimator reads beyond rewards and masks
        need_trainer = cfg.uses_prox_log_prob or needs.values or needs.score_norms
        if not need_trainer and self.reference is None:
            return
        wanted = {"prox": cfg.uses_prox_log_prob, "values": needs.values, "w": needs.score_norms,
                  "ref": self.reference is not None}
        out = {k: torch.zeros(batch.targets.shape) for k, want in wanted.items() if want}
        for rows in self._mine(batch, cfg.actor.log_prob_token_budget):
            micro = self._micro(batch, rows)
            got = {}
            if need_trainer:
                extra = "score_norm" if needs.score_norms else None
                got["prox"], got["w"], got["values"] = run_model(self.engine.module, micro, cfg.actor.temperature,
                                                                 self.layout, self.engine.device, extra=extra)
            if self.reference is not None:
                got["ref"] = run_model(self.reference, micro, cfg.actor.temperature, self.layout,
                                       self.engine.device)[0]
            for k, v in got.items():
                if k in out and rows:
                    out[k][rows, :v.shape[1]] = v.float().cpu()
        if self.world > 1:  # every rank filled its own rows, zeros elsewhere (the sp ranks of a group the same ones)
            for t in out.values():
                torch.distributed.all_reduce(t)
                t /= self.layout.sp
        batch.prox_logp, batch.old_values = out.get("prox"), out.get("values")
        batch.w_token, batch.ref_logp = out.get("w"), out.get("ref")

    def prepare(self, batch: Batch) -> dict:
        alg = self.cfg.algorithm
        self._precompute(batch)
        batch.logp_old = batch.prox_logp if batch.prox_logp is not None else batch.behav_logp
        rc = alg.rollout_correction
        here = not rc.bypass_mode  # bypass mode weighs and rejects per micro-batch (_bypass_correction)
        batch.is_weights, batch.loss_mask, stats = offpolicy.correct(
            batch.mask, prox_logp=batch.prox_logp, behav_logp=batch.behav_logp, token_lag=batch.token_lag,
            rollout_is=rc.rollout_is if here else None, rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs if here else None,
            rollout_rs_threshold=rc.rollout_rs_threshold, rollout_token_veto_threshold=rc.rollout_token_veto_threshold,
            max_token_lag=rc.max_token_lag)
        batch.adv_mask = batch.loss_mask if rc.mask_before_advantages else batch.mask
        if self.cfg.actor.overlong_filter:
            batch.loss_mask, stats[TRUNCATED_SHARE] = overlong_filter(batch)
        token_rewards = place_scores(batch.rewards, batch.mask)
        if alg.use_kl_in_reward:
            token_rewards, kl_stats = apply_kl_in_reward(token_rewards, batch.logp_old, batch.ref_logp, batch.mask,
                                                         alg.kl_penalty, self.kl_ctrl)
            stats.update(kl_stats)
        batch.advantages, batch.returns = compute_advantages(
            alg.adv_estimator, token_rewards, batch.mask, batch.group_index, values=batch.old_values,
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            keep=batch.adv_mask, w_token=batch.w_token, is_weights=batch.is_weights,
            reward_baselines=batch.reward_baselines)
        if alg.use_pf_ppo:
            rows = pf_ppo_indices(batch.rewards, alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow,
                                  seed=self.cfg.model.seed * 1_000_003 + int(self.engine.global_steps))
            for name, value in vars(batch.select(rows)).items():
                setattr(batch, name, value)
        m = batch.adv_mask
        stats["critic/advantages/mean"] = float(masked_mean(batch.advantages, m))
        stats["critic/advantages/max"] = float(batch.advantages[m > 0].max()) if bool((m > 0).any()) else 0.0
        stats["critic/advantages/min"] = float(batch.advantages[m > 0].min()) if bool((m > 0).any()) else 0.0
        if batch.old_values is not None:
            stats["critic/values/mean"] = float(masked_mean(batch.old_values, m))
            stats["critic/returns/mean"] = float(masked_mean(batch.returns, m))
        return stats

    # ---- step 6
    def _loss_params(self) -> LossParams:
        actor, pl = self.cfg.actor, self.cfg.actor.policy_loss
        return LossParams(clip_low=actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio,
                          clip_high=actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio,
                          clip_ratio_c=actor.clip_ratio_c, clip_cov_ratio=pl.clip_cov_ratio,
                          clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub, kl_cov_ratio=pl.kl_cov_ratio,
                          ppo_kl_coef=pl.ppo_kl_coef, tau_pos=actor.tau_pos, tau_neg=actor.tau_neg,
                          dro_beta=pl.dro_beta)

    def _bypass_correction(self, micro: Batch, logp: torch.Tensor) -> tuple[str, torch.Tensor, object, dict]:
        """verl's bypass loss: (loss mode, policy-loss mask, IS weights or None, metrics) of a micro-batch
        from pi_theta / mu with the current weights."""
        rc = self.cfg.algorithm.rollout_correction
        weights, keep, stats = offpolicy.correct(
            micro.loss_mask, prox_logp=logp.detach(), behav_logp=micro.behav_logp, rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
        stats.pop("rollout_corr/masked_fraction")  # prepare's (the lag mask's); the rejected share is rollout_rs_*
        if rc.loss_type == "reinforce":
            return "gpg", keep, weights, stats
        return "vanilla", keep, None, stats  # PPO's ratio pi_theta / mu is the correction: weights only logged

    def _micro_loss(self, micro: Batch, counts: tuple[int, int], critic_counts: tuple[int, int]
                    ) -> tuple[torch.Tensor, dict]:
        cfg, actor = self.cfg, self.cfg.actor
        logp, entropy, values = run_model(self.engine, micro, actor.temperature, self.layout, self.engine.device,
                                          extra="entropy", extra_grad=actor.entropy_coeff > 0)
        mode, lm = actor.loss_agg_mode, micro.loss_mask
        # seq-mean-token-sum-norm's constant: verl's padded response length unless set
        horizon = actor.loss_scale_factor if actor.loss_scale_factor is not None else cfg.rollout.response_length
        counts, critic_counts = (*counts, horizon), (*critic_counts, horizon)
        loss_mode, pg_mask, weights, bypass_stats = actor.policy_loss.loss_mode, lm, micro.is_weights, {}
        if cfg.algorithm.rollout_correction.bypass_mode:
            loss_mode, pg_mask, weights, bypass_stats = self._bypass_correction(micro, logp)
        pg, stats = policy_loss(loss_mode, logp, micro.logp_old, micro.advantages, pg_mask, self._loss_params(),
                                weights=weights, mode=mode, n_tokens=counts[0], n_seqs=counts[1], horizon=horizon)
        stats.update(bypass_stats)
        ent = agg_loss(entropy, lm, mode, *counts)
        total = pg - actor.entropy_coeff * ent if actor.entropy_coeff > 0 else pg
        shares = {"actor/pg_loss": pg.item(), "actor/entropy": ent.item()}
        if actor.use_kl_loss:
            kl = agg_loss(kl_estimate(logp, micro.ref_logp, actor.kl_loss_type), lm, mode, *counts)
            total = total + actor.kl_loss_coef * kl
            shares["actor/kl_loss"] = kl.item()
        if values is not None:
            vf, vstats = value_loss(values, micro.old_values, micro.returns, micro.adv_mask,
                                    cfg.critic.cliprange_value, mode, *critic_counts)
            total = total + cfg.critic.vf_coef * vf
            shares["critic/vf_loss"] = vf.item()
            stats.update(vstats)
        return total, {"shares": shares, "means": stats}

    def train(self, batch: Batch) -> dict:
        """Step 6: ``ppo_epochs`` passes over the mini-batches; each rank runs its micro-batches of each
        (packing.py), and DeepSpeed steps once per mini-batch (the boundary is set at its last micro-batch)."""
        cfg = self.cfg
        rows_per_mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        sums: dict[str, float] = {}
        means: dict[str, list[float]] = {}
        n_minis, grad_norm = 0, 0.0
        for _ in range(cfg.actor.ppo_epochs):
            for m0 in range(0, len(batch), rows_per_mini):
                mini = batch.rows(slice(m0, m0 + rows_per_mini))
                counts, critic_counts = agg_counts(mini.loss_mask), agg_counts(mini.adv_mask)
                mine = self._mine(mini, cfg.actor.ppo_max_token_len_per_gpu)
                for u, rows in enumerate(mine):
                    self.engine.set_gradient_accumulation_boundary(u == len(mine) - 1)
                    loss, s = self._micro_loss(self._micro(mini, rows), counts, critic_counts)
                    # DeepSpeed averages gradients over the data-parallel ranks: undo it, so that the micro losses
                    # of all ranks, normalised by the whole mini-batch's counts, add up to the mini-batch loss. A
                    # sequence-parallel group computes each micro loss whole on each of its sp ranks, and the
                    # gather of its log-probs sums their gradients: 1/sp each.
                    sp = self.layout.sp
                    self.engine.backward(loss * (self.world // sp) / sp, scale_wrt_gas=False)
                    grad_norm = step_with_grad_norm(self.engine, grad_norm)
                    if not rows:
                        continue  # a stand-in: nothing of it is a metric
                    for k, v in s["shares"].items():
                        sums[k] = sums.get(k, 0.0) + v
                    for k, v in s["means"].items():
                        means.setdefault(k, []).append(v)
                n_minis += 1
        out = {k: v / max(n_minis, 1) for k, v in sums.items()}
        for k, vs in means.items():
            out[k] = max(vs) if k.endswith("_max") else min(vs) if k.endswith("_min") else sum(vs) / len(vs)
        out["actor/grad_norm"] = grad_norm  # of the last mini-batch, before clipping
        out["actor/optimizer_steps"] = self.engine.global_steps  # since the run began (kept across resumes)
        if cfg.actor.use_kl_loss:
            out["actor/kl_coef"] = cfg.actor.kl_loss_coef
        return out
