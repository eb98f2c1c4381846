"""The policy-loss modes of ``actor.policy_loss.loss_mode`` against verl 0.9.1's definitions, on hand-made tensors."""
import math

import pytest
import torch

from hpcrl.config.registries import POLICY_LOSS_MODES
from hpcrl.trainer.losses import agg_counts, ppo_policy_loss
from hpcrl.trainer.policy_losses import LossParams, policy_loss

LOG = math.log
P = LossParams(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0, dro_beta=0.1)


def test_every_mode_has_an_implementation_and_a_bogus_one_is_refused():
    logp = torch.zeros(2, 3, requires_grad=True)
    for name in POLICY_LOSS_MODES:
        loss, _ = policy_loss(name, logp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3), P)
        assert math.isfinite(loss.item())
    with pytest.raises(ValueError, match="geo_mean"):
        policy_loss("ppo2", logp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3), P)


def test_vanilla_is_ppo_clip_with_dual_clip():
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    a, _ = policy_loss("vanilla", logp, torch.zeros(1, 3), adv, torch.ones(1, 3), P)
    b, _ = ppo_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    assert a.item() == b.item()


def test_gspo_uses_the_sequence_geometric_mean_ratio():
    # row 0: ratios 1.1, 1.1 -> s = 1.1, A = +1, inside the clip: l = -1.1 on both tokens
    # row 1: ratios 2.0, 0.5 -> s = 1, A = -1: l = 1.0; a per-token PPO would see ratio 2.0 here
    # row 2: ratios 1.5, 1.5 -> s = 1.5 > 1.2 with A = +1: clipped, l = -1.2, no gradient
    logp = torch.log(torch.tensor([[1.1, 1.1, 9.0], [2.0, 0.5, 9.0], [1.5, 1.5, 9.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, s = policy_loss("gspo", logp, torch.zeros(3, 3), adv, mask, P, mode="seq-mean-token-mean")
    assert abs(loss.item() - (-1.1 + 1.0 - 1.2) / 3) < 1e-6
    loss.backward()
    # d l_t / d logp_t = -A s_i (the value of s_it is s_i, its gradient that of log pi_t), / (n_i |S|)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1 / 6, -1.1 / 6, 0.0], [1 / 6, 1 / 6, 0.0], [0.0, 0.0, 0.0]]))
    assert abs(s["actor/pg_clipfrac"] - 2 / 6) < 1e-6


def test_gspo_aggregates_with_the_actors_loss_agg_mode_as_verl_0_9_1():
    # row 0: one token, ratio 1.1, A = +1: l = -1.1; row 1: ratios 2.0, 0.5 -> s = 1, A = -1: l = 1.0, 1.0.
    # Lengths differ, so the modes differ: verl 0.9.1 passes the actor's loss_agg_mode to gspo.
    logp = torch.log(torch.tensor([[1.1, 1.0], [2.0, 0.5]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    want = {"token-mean": (-1.1 + 1.0 + 1.0) / 3, "token-sum": -1.1 + 1.0 + 1.0,
            "seq-mean-token-mean": (-1.1 + 1.0) / 2, "seq-mean-token-sum": (-1.1 + 2.0) / 2}
    for mode, value in want.items():
        loss, _ = policy_loss("gspo", logp, torch.zeros(2, 2), adv, mask, P, mode=mode)
        assert abs(loss.item() - value) < 1e-6, mode


def test_cispo_weights_log_prob_by_the_detached_clipped_ratio_and_keeps_the_gradient_of_clipped_tokens():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    loss, s = policy_loss("cispo", logp, torch.zeros(1, 3), adv, torch.ones(1, 3), P)
    want = (-1.2 * LOG(1.5) - 0.8 * LOG(0.5) + 2.0 * 1.0 * 0.0) / 3
    assert abs(loss.item() - want) < 1e-6
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 / 3, -0.8 / 3, 2.0 / 3]]))
    assert abs(s["actor/pg_clipfrac"] - 2 / 3) < 1e-6


def test_gpg_is_minus_advantage_times_log_prob():
    logp = torch.log(torch.tensor([[0.5, 0.1]])).requires_grad_()
    adv = torch.tensor([[2.0, -1.0]])
    loss, _ = policy_loss("gpg", logp, torch.zeros(1, 2), adv, torch.ones(1, 2), P, mode="token-sum")
    assert abs(loss.item() - (-2.0 * LOG(0.5) + 1.0 * LOG(0.1))) < 1e-6
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv)


# cov_t = (A_t - mean A)(logp_t - mean logp): mean A = 0, mean logp = -1.775 -> cov = [3.35, 6.45, 0, 0]:
# only token 0 lies in (lb, ub) = (1, 5); token 1 has the largest covariance
COV_LOGP = [[-0.1, -5.0, -1.0, -1.0]]
COV_ADV = [[2.0, -2.0, 0.0, 0.0]]


def test_clip_cov_cuts_the_gradient_of_the_chosen_in_band_tokens():
    logp = torch.tensor(COV_LOGP, requires_grad=True)
    adv = torch.tensor(COV_ADV)
    p = LossParams(clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0)  # k = 2 > the one candidate
    loss, s = policy_loss("clip_cov", logp, logp.detach(), adv, torch.ones(1, 4), p)
    # ratio 1 everywhere: l = -A, token 0 cut to 0
    assert abs(loss.item() - 2.0 / 4) < 1e-6
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    assert abs(s["actor/pg_clipfrac"] - 1 / 4) < 1e-6
    # a token the PPO clip already cut is no candidate: with ratio 1.5 and A > 0, token 0 is clipped
    logp2 = torch.tensor(COV_LOGP, requires_grad=True)
    old2 = logp2.detach() - torch.tensor([[LOG(1.5), 0.0, 0.0, 0.0]])
    _, s2 = policy_loss("clip_cov", logp2, old2, adv, torch.ones(1, 4), p)
    assert s2["actor/pg_clipfrac"] == 0


def test_kl_cov_penalises_the_largest_covariance_tokens_without_any_clip():
    logp = torch.tensor(COV_LOGP, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.5, 0.1, 0.0, 0.0]])  # token 0's ratio e^0.5 stays unclipped
    p = LossParams(kl_cov_ratio=0.25, ppo_kl_coef=0.1)  # k = max(1, floor(4 * 0.25)) = 1: token 1
    loss, s = policy_loss("kl_cov", logp, old, torch.tensor(COV_ADV), torch.ones(1, 4), p)
    want = (-2.0 * math.exp(0.5) + 2.0 * math.exp(0.1) + 0.1 * 0.1) / 4
    assert abs(loss.item() - want) < 1e-6
    assert abs(s["actor/pg_clipfrac"] - 1 / 4) < 1e-6
    # verl reports kl_cov's ppo_kl as the mean absolute log-ratio: (0.5 + 0.1 + 0 + 0) / 4
    assert abs(s["actor/ppo_kl"] - 0.6 / 4) < 1e-6


def test_kl_cov_reports_the_mean_absolute_log_ratio_as_ppo_kl():
    # B = L = 1, logp = -1.0, logp_old = -1.5, A = 1: l = -e^0.5 + 0.1 * 0.5 = -1.59872 (the one token is
    # the top covariance); verl's actor/ppo_kl = mean abs(logp - logp_old) = 0.5 (signed -log-ratio: -0.5)
    loss, s = policy_loss("kl_cov", torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[1.0]]),
                          torch.ones(1, 1), LossParams())
    assert abs(loss.item() - (-1.59872)) < 1e-5
    assert abs(s["actor/ppo_kl"] - 0.5) < 1e-7


def test_geo_mean_clips_log_ratios_towards_the_advantage_sign_and_averages_per_sequence():
    # row 0, A = +1: log-ratios 0.5, -0.1 -> clipped 0.2, -0.1 (min of the two for A > 0): rho = e^0.05
    # row 1, A = -1: log-ratios 0.5, -0.5 -> 0.5, -0.2 (max for A < 0): rho = e^0.15
    lr = torch.tensor([[0.5, -0.1], [0.5, -0.5]])
    logp = lr.clone().requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, s = policy_loss("geo_mean", logp, torch.zeros(2, 2), adv, torch.ones(2, 2), P, mode="token-sum")
    assert abs(loss.item() - (-math.exp(0.05) + math.exp(0.15)) / 2) < 1e-6
    loss.backward()
    want = torch.tensor([[0.0, -math.exp(0.05) / 4], [math.exp(0.15) / 4, 0.0]])
    torch.testing.assert_close(logp.grad, want)
    # verl's statistic: tokens whose log-ratio lies outside [-eps_low, eps_high], by the sign of A
    assert abs(s["actor/pg_clipfrac"] - 1 / 4) < 1e-6 and abs(s["actor/pg_clipfrac_lower"] - 2 / 4) < 1e-6


@pytest.mark.parametrize("name", POLICY_LOSS_MODES)
def test_importance_weights_scale_every_mode_and_masked_tokens_count_nothing(name):
    torch.manual_seed(0)
    logp = (torch.randn(3, 4) * 0.1 - 1.0).requires_grad_()
    old = logp.detach() + torch.randn(3, 4) * 0.05
    adv = torch.randn(3, 1).expand(3, 4).contiguous()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1.0]])
    base, _ = policy_loss(name, logp, old, adv, mask, P)
    twice, _ = policy_loss(name, logp, old, adv, mask, P, weights=torch.full((3, 4), 2.0))
    assert abs(twice.item() - 2 * base.item()) < 1e-5
    base.backward()
    assert torch.all(logp.grad[mask == 0] == 0)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "gpg", "geo_mean", "dppo_tv", "dppo_kl", "sapo", "dro"])
def test_micro_batches_add_up_to_the_mini_batch_loss(name):
    """(clip_cov and kl_cov choose their tokens per micro-batch, as verl's do: no such identity.)"""
    torch.manual_seed(1)
    logp = torch.randn(6, 5) * 0.1 - 1.0
    old = logp + torch.randn(6, 5) * 0.1
    adv = torch.randn(6, 1).expand(6, 5).contiguous()
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[4] = 0
    whole, _ = policy_loss(name, logp, old, adv, mask, P)
    n_tokens, n_seqs = agg_counts(mask)
    parts = sum(policy_loss(name, logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], P, n_tokens=n_tokens,
                            n_seqs=n_seqs)[0] for i in range(0, 6, 2))
    assert abs(whole.item() - parts.item()) < 1e-5


# ---- verl 0.9.1's later modes, against hand computations

# (q = pi_old(y_t), p = pi_theta(y_t), A_t): a DPPO trust region is a divergence of p from q
DPPO = [(0.5, 0.75, 1.0),   # p - q = 0.25 > 0.2: outside TV's region; binary KL 0.144 <= 0.2: inside KL's
        (0.5, 0.6, 1.0),    # inside both, ratio 1.2
        (0.5, 0.35, -1.0),  # A < 0 and p - q = -0.15 >= -0.2: inside both, ratio 0.7
        (0.1, 0.35, -1.0),  # A < 0, p > q: inside both; ratio 3.5 truncated at C = 3
        (0.5, 0.1, -1.0)]   # A < 0, p - q = -0.4; binary KL 0.511: outside both


def _dppo_inputs():
    q, p, a = (torch.tensor([[row[i] for row in DPPO]]) for i in range(3))
    return p.log().requires_grad_(), q.log(), a


@pytest.mark.parametrize("mode, valid", [("dppo_tv", [0, 1, 1, 1, 0]), ("dppo_kl", [1, 1, 1, 1, 0])])
def test_dppo_is_reinforce_with_a_truncated_detached_ratio_inside_a_probability_trust_region(mode, valid):
    logp, old, adv = _dppo_inputs()
    loss, s = policy_loss(mode, logp, old, adv, torch.ones(1, 5), P)
    ratio = [min(p / q, 3.0) for q, p, _ in DPPO]
    want = sum(-a * r * LOG(p) * v for (q, p, a), r, v in zip(DPPO, ratio, valid)) / 5
    assert abs(loss.item() - want) < 1e-6
    loss.backward()  # the ratio carries no gradient: d l_t / d logp_t = -A_t min(r_t, C) v_t
    want_grad = [-a * r * v / 5 for (_, _, a), r, v in zip(DPPO, ratio, valid)]
    torch.testing.assert_close(logp.grad, torch.tensor([want_grad]))
    assert abs(s["actor/pg_clipfrac"] - valid.count(0) / 5) < 1e-6
    assert abs(s["actor/pg_clipfrac_lower"] - 1 / 5) < 1e-6  # token 3: inside, ratio above C


def test_sapo_gates_the_ratio_smoothly_and_always_averages_per_sequence():
    # f(r) = sigmoid(tau (r - 1)) 4 / tau; tau = 1 where A > 0, 1.05 where A <= 0
    def f(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))
    p = LossParams(tau_pos=1.0, tau_neg=1.05)
    logp = torch.log(torch.tensor([[1.0, 1.5], [0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for mode in ("token-mean", "token-sum"):  # verl aggregates sapo with seq-mean-token-mean whatever the mode
        loss, s = policy_loss("sapo", logp, torch.zeros(2, 2), adv, mask, p, mode=mode)
        want = (-(f(1.0, 1.0) + f(1.5, 1.0)) / 2 + f(0.5, 1.05)) / 2
        assert abs(loss.item() - want) < 1e-6
    loss.backward()  # d l / d logp = -A f'(r) r = -A 4 sigma (1 - sigma) r; at r = 1: -A
    assert abs(float(logp.grad[0, 0]) - (-1.0 / 4)) < 1e-6
    assert s["actor/pg_clipfrac"] == 0.0


def test_dro_is_reinforce_minus_a_quadratic_log_ratio_penalty():
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25]]))
    loss, s = policy_loss("dro", logp, old, torch.ones(1, 1), torch.ones(1, 1), LossParams(dro_beta=0.5))
    assert abs(loss.item() - (-LOG(0.5) + 0.25 * LOG(2) ** 2)) < 1e-6
    loss.backward()  # -(A - beta (logp - logp_old))
    assert abs(float(logp.grad) - (-(1 - 0.5 * LOG(2)))) < 1e-6
    assert abs(s["actor/ppo_kl"] + LOG(2)) < 1e-6
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss("dro", logp, old, torch.ones(1, 1), torch.ones(1, 1), LossParams())
