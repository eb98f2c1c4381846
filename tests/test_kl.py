"""KL estimators against the exact KL of small categorical distributions, and the controllers."""
import math

import pytest
import torch

from hpcrl.trainer.kl import AdaptiveKLController, FixedKLController, apply_kl_in_reward, kl_estimate


def test_estimators_match_their_formulas():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    x = logp - ref
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), x)
    torch.testing.assert_close(kl_estimate(logp, ref, "kl"), x)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * x * x)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.exp(-x) - 1 + x)
    torch.testing.assert_close(kl_estimate(logp, ref, "low_var_kl"), torch.exp(-x) - 1 + x)
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), x.abs())


def test_k3_is_non_negative_everywhere_k1_is_not():
    torch.manual_seed(0)
    logp, ref = torch.randn(10000) * 3, torch.randn(10000) * 3
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)
    assert torch.any(kl_estimate(logp, ref, "k1") < 0)
    assert torch.all(kl_estimate(logp, logp, "k3") == 0)
    assert torch.isfinite(kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_for_kl_pi_ref_under_samples_from_pi(kind):
    """E_{y~pi}[estimate] = sum_y pi(y) log(pi(y)/ref(y)): computed exactly over the support."""
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = float((pi * (pi / ref).log()).sum())
    expectation = float((pi * kl_estimate(pi.log(), ref.log(), kind)).sum())
    assert abs(expectation - exact) < 1e-6


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    c.update(10.0, 1000)
    assert c.value == 0.05


def test_adaptive_controller_moves_towards_the_target_by_the_clipped_error():
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    c.update(current_kl=1.0, n_steps=10)  # error 9 -> clipped to 0.2
    assert abs(c.value - 0.1 * (1 + 0.2 * 10 / 100)) < 1e-12
    c2 = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    c2.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert abs(c2.value - 0.1 * (1 - 0.1 * 10 / 100)) < 1e-12


def test_kl_in_reward_subtracts_beta_times_kl_on_model_tokens_only():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, -1.5], [-1.5, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ctrl = AdaptiveKLController(0.5, target_kl=1.0, horizon=10)
    out, s = apply_kl_in_reward(r, logp, ref, mask, "k1", ctrl)
    want = r - 0.5 * torch.tensor([[1.0, 0.0, 0.5], [0.5, 0.5, 0.0]])
    torch.testing.assert_close(out, want)
    per_seq = [(1.0 + 0.0 + 0.5) / 3, (0.5 + 0.5) / 2]
    assert abs(s["actor/reward_kl_penalty"] - sum(per_seq) / 2) < 1e-6
    assert s["actor/reward_kl_penalty_coeff"] == 0.5, "the coefficient used, before the controller moves it"
    err = max(-0.2, min(0.2, s["actor/reward_kl_penalty"] / 1.0 - 1))
    assert math.isclose(ctrl.value, 0.5 * (1 + err * 2 / 10))


@pytest.mark.parametrize("kind", ["kl+", "k1+", "abs+", "low_var_kl+", "k3+", "mse+", "k2+"])
def test_straight_through_forms_have_the_base_value_and_the_gradient_of_k2(kind):
    """verl 0.9.1's "+" forms: value of the base estimator, gradient of k2 = x (x = logp - ref)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    est = kl_estimate(logp, ref, kind)
    torch.testing.assert_close(est, kl_estimate(logp.detach(), ref, kind[:-1]))
    est.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -1.0, 0.0]))
    # the base k3's own gradient differs: 1 - exp(-x)
    plain = logp.detach().clone().requires_grad_()
    kl_estimate(plain, ref, "k3").sum().backward()
    assert not torch.allclose(plain.grad, logp.grad)
