"""The trainer's tensor math under CUDA's rules: every advantage estimator, policy loss, KL estimator,
aggregation, off-policy correction and PF-PPO draw.

Each test runs on two devices:

- ``cpu-strict`` (always): the inputs are on the CPU and the code under test runs with a ``meta``
  default device, so a tensor it creates without ``device=`` lands on ``meta`` and meets its inputs
  in an error, as a CPU-made tensor meets CUDA inputs on a GPU; CUDA's index-put rule is on for the
  whole session (``tests/cuda_rules``). The result must equal a plain CPU run's.
- ``cuda`` (marked ``gpu``, skipped where torch sees no GPU): the inputs are on the GPU and the result
  must equal the CPU run's (to float32 rounding), on the inputs' device and in their dtype.

The first GPU this code met crashed at the first GRPO update (a float64 group mean put into a
float32 tensor by a mask): these tests are how that class of bug fails on CPU, in CI.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from hpcrl.config.names import KL_ESTIMATORS, LOSS_AGG_MODES, PF_PPO_REWEIGHT_METHODS, RS_OPTIONS
from hpcrl.config.registries import ADV_ESTIMATORS, POLICY_LOSS_MODES
from hpcrl.trainer.advantages import compute_advantages, masked_whiten, place_scores
from hpcrl.trainer.kl import AdaptiveKLController, apply_kl_in_reward, kl_estimate
from hpcrl.trainer.losses import agg_counts, agg_loss, entropy_from_logp, value_loss
from hpcrl.trainer.offpolicy import correct
from hpcrl.trainer.pf_ppo import pf_ppo_indices
from hpcrl.trainer.policy_losses import LossParams, policy_loss
from hpcrl.trainer.token_baseline import score_norm_sq

NO_GPU = "no CUDA device: torch.cuda.is_available() is False (these run on a GPU node: bench/gpu_check.sh)"
DEVICES = ["cpu-strict", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_GPU)])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def on(device: str):
    """Where the code under test runs: the meta default device for cpu-strict, nothing special on cuda."""
    return torch.device("meta") if device == "cpu-strict" else contextlib.nullcontext()


def home(device: str) -> str:
    return "cpu" if device == "cpu-strict" else device


def inputs(device: str) -> dict:
    """Two groups of four trajectories, 7 response positions, a tool token, padding, a lag of 0-2."""
    g = torch.Generator().manual_seed(0)
    B, L = 8, 7
    mask = torch.ones(B, L)
    mask[:, 5:] = 0
    mask[1, 3:] = 0
    mask[2, 2] = 0  # a tool token
    mask[6, 1:] = 0
    keep = mask.clone()
    keep[4, 1] = 0
    t = {
        "mask": mask, "keep": keep,
        "logp": -torch.rand(B, L, generator=g) * 2, "logp_old": -torch.rand(B, L, generator=g) * 2,
        "ref_logp": -torch.rand(B, L, generator=g) * 2, "values": torch.randn(B, L, generator=g),
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5, 0.6, 0.6, 0.6, 0.6]),
        "group_index": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        "w_token": torch.rand(B, L, generator=g), "is_weights": 0.5 + torch.rand(B, L, generator=g),
        "baselines": torch.tensor([0.5] * 4 + [0.6] * 4), "lag": torch.randint(0, 3, (B, L), generator=g),
        "advantages": torch.randn(B, L, generator=g), "returns": torch.randn(B, L, generator=g),
        "logits": torch.randn(B, L, 11, generator=g), "targets": torch.randint(0, 11, (B, L), generator=g),
    }
    return {k: v.to(home(device)) for k, v in t.items()}


def same(result, reference, device: str) -> None:
    """``result`` (on the device) equals ``reference`` (a plain CPU run): same dtype, the inputs' device."""
    if isinstance(result, (tuple, list)):
        assert len(result) == len(reference)
        for r, e in zip(result, reference):
            same(r, e, device)
        return
    if isinstance(result, dict):
        assert result.keys() == reference.keys()
        for k in result:
            assert result[k] == pytest.approx(reference[k], rel=1e-4, abs=1e-5), k
        return
    if not isinstance(result, torch.Tensor):
        assert result == pytest.approx(reference, rel=1e-4, abs=1e-5)
        return
    assert result.device.type == home(device) and result.dtype == reference.dtype
    torch.testing.assert_close(result.detach().cpu(), reference.detach(), rtol=1e-4, atol=1e-5)


def check(device: str, fn) -> None:
    """``fn(tensors)`` on the device (under its rules) equals ``fn`` on plain CPU tensors."""
    reference = fn(inputs("cpu-strict"))
    t = inputs(device)
    with on(device):
        result = fn(t)
    same(result, reference, device)


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_every_advantage_estimator_holds_under_cuda_rules(device, estimator):
    def fn(t):
        token_rewards = place_scores(t["rewards"], t["mask"])
        return compute_advantages(estimator, token_rewards, t["mask"], t["group_index"], values=t["values"],
                                  gamma=0.99, lam=0.95, keep=t["keep"], w_token=t["w_token"],
                                  is_weights=t["is_weights"], reward_baselines=t["baselines"])
    check(device, fn)


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_every_policy_loss_and_its_gradient_hold_under_cuda_rules(device, mode):
    def fn(t):
        logp = t["logp"].clone().requires_grad_(True)
        torch.manual_seed(0)  # clip_cov / kl_cov draw tokens
        loss, stats = policy_loss(mode, logp, t["logp_old"], t["advantages"], t["keep"], LossParams(dro_beta=0.1),
                                  weights=t["is_weights"], horizon=7)
        loss.backward()
        return loss.detach(), logp.grad, {k: v for k, v in stats.items() if "cov" not in mode}
    if mode in ("clip_cov", "kl_cov") and device == "cuda":  # a random draw: CUDA's generator differs
        t = inputs(device)
        with on(device):
            loss, grad, _ = fn(t)
        assert torch.isfinite(loss) and grad.device.type == "cuda"
        return
    check(device, fn)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_every_aggregation_and_the_value_loss_hold_under_cuda_rules(device, agg):
    def fn(t):
        n_tokens, n_seqs = agg_counts(t["keep"])
        ent = agg_loss(entropy_from_logp(torch.log_softmax(t["logits"], -1)), t["keep"], agg, n_tokens, n_seqs, 7)
        vf, stats = value_loss(t["values"], t["values"] * 0.9, t["returns"], t["keep"], 0.2, agg, n_tokens, n_seqs, 7)
        return ent, vf, stats, score_norm_sq(torch.log_softmax(t["logits"], -1), t["targets"])
    check(device, fn)


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_every_kl_estimator_and_the_kl_in_reward_hold_under_cuda_rules(device, kind):
    def fn(t):
        token_rewards = place_scores(t["rewards"], t["mask"])
        shaped, stats = apply_kl_in_reward(token_rewards, t["logp"], t["ref_logp"], t["mask"], kind,
                                           AdaptiveKLController(0.1, 6.0, 100))
        return kl_estimate(t["logp"], t["ref_logp"], kind), shaped, stats
    check(device, fn)


@pytest.mark.parametrize("rs", [None, *RS_OPTIONS, "token_k1,seq_max_k2"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_off_policy_correction_holds_under_cuda_rules(device, level, rs):
    def fn(t):
        threshold = None if rs is None else ",".join("0.5_2.0" if o.endswith("k1") else "2.0" for o in rs.split(","))
        weights, keep, stats = correct(t["mask"], prox_logp=t["logp"], behav_logp=t["logp_old"], token_lag=t["lag"],
                                       rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                       rollout_rs=rs, rollout_rs_threshold=threshold,
                                       rollout_token_veto_threshold=1e-4, max_token_lag=1)
        return weights, keep, stats, masked_whiten(t["advantages"], keep)
    check(device, fn)


@pytest.mark.parametrize("method", PF_PPO_REWEIGHT_METHODS)
def test_pf_ppo_draws_the_same_rows_on_every_device(device, method):
    check(device, lambda t: pf_ppo_indices(t["rewards"], method, 2.0, seed=7))


def test_the_strict_device_catches_a_tensor_made_without_device():
    """The rule itself: code that makes a tensor without ``device=`` fails under cpu-strict."""
    def careless(x):
        return x + torch.ones(x.shape[0])

    t = inputs("cpu-strict")
    careless(t["rewards"])  # a plain CPU run cannot see it
    with on("cpu-strict"), pytest.raises(RuntimeError, match="meta"):
        careless(t["rewards"])


def test_the_index_put_rule_refuses_what_cuda_refuses():
    """tests/cuda_rules: a float64 0-dim value put into float32 by a mask (CPU would cast it)."""
    from cuda_rules import CudaRuleError

    x, sel = torch.zeros(4), torch.tensor([True, False, True, False])
    with pytest.raises(CudaRuleError, match="float64 and the destination torch.float32"):
        x[sel] = torch.tensor(0.5, dtype=torch.float64)
    with pytest.raises(CudaRuleError):
        x.index_put_((sel,), torch.tensor(0.5, dtype=torch.float64))
    x[sel] = torch.tensor(0.5)  # same dtype: allowed
    x[1:3] = torch.tensor([1.0, 2.0], dtype=torch.float64)  # a slice copies with a cast on CUDA too
    assert x.tolist() == [0.5, 1.0, 2.0, 0.0]
