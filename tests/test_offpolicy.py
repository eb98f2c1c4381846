"""Off-policy corrections (truncated IS, rejection, veto, lag masks) against their definitions."""
import math

import pytest
import torch

from hpcrl.trainer.offpolicy import correct, importance_weights, rejection_mask

LOG = math.log


def test_token_level_truncated_importance_weights():
    log_rho = torch.tensor([[LOG(0.5), LOG(1.5), LOG(4.0), LOG(9.0)]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, raw = importance_weights(log_rho, mask, "token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 0.0]]))
    torch.testing.assert_close(raw, torch.tensor([[0.5, 1.5, 4.0, 0.0]]))


def test_sequence_level_weight_is_the_truncated_product_over_model_tokens():
    log_rho = torch.tensor([[LOG(1.2), LOG(1.5), LOG(100.0)], [LOG(0.5), LOG(0.8), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, raw = importance_weights(log_rho, mask, "sequence", threshold=1.5)
    torch.testing.assert_close(raw, torch.tensor([[1.8, 1.8, 0.0], [0.4, 0.4, 0.4]]))
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [0.4, 0.4, 0.4]]))


@pytest.mark.parametrize("level, keep", [
    ("token", [[1, 0, 1], [1, 1, 0]]),
    ("sequence", [[0, 0, 0], [0, 0, 0]]),     # products 2.4 and 0.9*1.1*0.58=0.574
    ("geometric", [[1, 1, 1], [1, 1, 1]]),    # geometric means 2.4^(1/3)=1.34 and 0.574^(1/3)=0.83
])
def test_rejection_masks_keep_what_lies_inside_the_bounds(level, keep):
    log_rho = torch.tensor([[LOG(1.0), LOG(2.4), LOG(1.0)], [LOG(0.9), LOG(1.1), LOG(0.58)]])
    mask = torch.ones(2, 3)
    torch.testing.assert_close(rejection_mask(log_rho, mask, level, upper=1.5, lower=0.6),
                               torch.tensor(keep, dtype=torch.float32))


def test_correct_combines_is_rejection_veto_and_lag_masks_and_reports_fractions():
    behav = torch.zeros(3, 2)
    prox = torch.tensor([[LOG(3.0), 0.0], [LOG(1e-5), 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    lag = torch.tensor([[0, 0], [0, 0], [2, 0]])
    w, loss_mask, s = correct(mask, prox_logp=prox, behav_logp=behav, token_lag=lag, rollout_is="token",
                              rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=5.0,
                              rollout_token_veto_threshold=1e-4, max_token_lag=1)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0], [1e-5, 1.0], [1.0, 0.0]]))
    # row 1: 1e-5 is below the RS lower bound 1/5 and below the veto -> the whole sequence goes
    # row 2: its only model token has lag 2 > 1
    torch.testing.assert_close(loss_mask, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    assert abs(s["rollout_corr/masked_fraction"] - 3 / 5) < 1e-6
    assert abs(s["rollout_corr/rollout_rs_masked_fraction"] - 1 / 5) < 1e-6
    assert abs(s["rollout_corr/rollout_veto_fraction"] - 2 / 5) < 1e-6
    assert abs(s["rollout_corr/lag_masked_fraction"] - 1 / 5) < 1e-6
    assert abs(s["rollout_corr/rollout_is_truncated_fraction"] - 1 / 5) < 1e-6
    assert s["fully_async/token_lag/max"] == 2


def test_mismatch_kl_metrics_estimate_kl_behaviour_to_prox():
    """k1 = mean(log mu - log pi_prox), k3 = mean(rho - 1 - log rho); both 0 when the two agree."""
    prox = torch.tensor([[LOG(0.5), LOG(0.2)]])
    behav = torch.tensor([[LOG(0.4), LOG(0.25)]])
    _, _, s = correct(torch.ones(1, 2), prox_logp=prox, behav_logp=behav)
    lr = prox - behav
    assert abs(s["rollout_corr/kl"] - float((-lr).mean())) < 1e-6
    assert abs(s["rollout_corr/k3_kl"] - float((lr.exp() - 1 - lr).mean())) < 1e-6
    assert s["rollout_corr/k3_kl"] >= 0
    _, m, s0 = correct(torch.ones(1, 2), prox_logp=behav, behav_logp=behav)
    assert s0["rollout_corr/kl"] == 0 and s0["rollout_corr/k3_kl"] == 0 and torch.all(m == 1)


def test_without_prox_log_probs_only_the_lag_mask_applies():
    mask = torch.ones(1, 3)
    w, m, s = correct(mask, prox_logp=None, behav_logp=torch.zeros(1, 3), token_lag=torch.tensor([[0, 1, 3]]),
                      max_token_lag=1)
    assert w is None and "rollout_corr/kl" not in s
    torch.testing.assert_close(m, torch.tensor([[1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError):
        correct(mask, prox_logp=None, behav_logp=torch.zeros(1, 3), rollout_is="token")


def test_an_empty_mask_gives_finite_metrics():
    w, m, s = correct(torch.zeros(2, 2), prox_logp=torch.zeros(2, 2), behav_logp=torch.ones(2, 2),
                      token_lag=torch.zeros(2, 2, dtype=torch.long), rollout_is="sequence", rollout_rs="geometric",
                      max_token_lag=0)
    assert torch.all(w == 0) and torch.all(m == 0)
    assert all(math.isfinite(v) for v in s.values())
