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


def test_icepop_keeps_the_ratio_inside_lower_upper_and_zeroes_it_outside():
    """verl 0.9.1's rollout_is_threshold "lower_upper": no truncation, weights outside the band are 0."""
    log_rho = torch.tensor([[LOG(0.4), LOG(1.0), LOG(1.9), LOG(2.5)]])
    mask = torch.ones(1, 4)
    w, raw = importance_weights(log_rho, mask, "token", threshold="0.5_2.0")
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.9, 0.0]]))
    torch.testing.assert_close(raw, torch.tensor([[0.4, 1.0, 1.9, 2.5]]))
    # sequence level: products 0.4 * 1.0 = 0.4 (outside) and 1.9 * 1.0 = 1.9 (inside)
    seq = torch.tensor([[LOG(0.4), 0.0], [LOG(1.9), 0.0]])
    w, _ = importance_weights(seq, torch.ones(2, 2), "sequence", threshold="0.5_2.0")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.9, 1.9]]))
    # batch-normalised after the band: mean of [0, 1, 1.9, 0] is 0.725
    w, _ = importance_weights(log_rho, mask, "token", threshold="0.5_2.0", batch_normalize=True)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.9, 0.0]]) / 0.725)
    _, loss_mask, stats = correct(mask, prox_logp=log_rho, behav_logp=torch.zeros(1, 4), rollout_is="token",
                                  rollout_is_threshold="0.5_2.0")
    assert abs(stats["rollout_corr/rollout_is_oob_ratio"] - 2 / 4) < 1e-6
    torch.testing.assert_close(loss_mask, mask)  # zero weights, not rejection: the tokens stay in the denominators


# rho per token: [[1.0, 2.4, 1.0], [0.9, 1.1, 0.58]]; sequence products 2.4 and 0.574, geometric means
# 1.339 and 0.831. k1 bounds apply to 1/rho: [[1, 0.417, 1], [1.111, 0.909, 1.724]], products of 1/rho
# 0.417 and 1.742, geometric means 0.747 and 1.203. The asymmetric bounds are chosen so that reading
# them as bounds on rho itself (verl 0.6) would keep different tokens.
@pytest.mark.parametrize("rollout_rs, threshold, keep", [
    ("token_k1", "0.5_1.25", [[1, 0, 1], [1, 1, 0]]),      # on rho: 0.58 would be kept
    ("seq_sum_k1", "0.3_1.5", [[1, 1, 1], [0, 0, 0]]),     # on rho: the opposite rows
    ("seq_mean_k1", "0.7_1.1", [[1, 1, 1], [0, 0, 0]]),    # on rho: the opposite rows
    ("token_k1", 1.5, [[1, 0, 1], [1, 1, 0]]),             # one number: lower = 1/1.5
    ("token_k2", 0.1, [[1, 0, 1], [1, 1, 0]]),             # (log rho)^2/2: 0.383 and 0.149 > 0.1
    ("token_k3", 0.1, [[1, 0, 1], [1, 1, 0]]),             # rho-1-log rho: 0.525 and 0.125 > 0.1
    ("seq_sum_k3", 0.2, [[0, 0, 0], [1, 1, 1]]),           # sums 0.525 and 0.135
    ("seq_mean_k2", 0.1, [[0, 0, 0], [1, 1, 1]]),          # means 0.128 and 0.053
    ("seq_max_k3", 0.2, [[0, 0, 0], [1, 1, 1]]),           # maxima 0.525 and 0.125
    ("token_k1,seq_max_k3", "0.5_1.25,0.2", [[0, 0, 0], [1, 1, 0]]),  # both must keep
])
def test_rejection_keeps_what_verl_0_9_1_keeps(rollout_rs, threshold, keep):
    log_rho = torch.tensor([[LOG(1.0), LOG(2.4), LOG(1.0)], [LOG(0.9), LOG(1.1), LOG(0.58)]])
    mask = torch.ones(2, 3)
    got, stats = rejection_mask(log_rho, mask, rollout_rs, threshold)
    torch.testing.assert_close(got, torch.tensor(keep, dtype=torch.float32))
    for opt in rollout_rs.split(","):
        assert f"rollout_corr/rollout_rs_{opt}_masked_fraction" in stats


def test_a_pasted_verl_0_9_1_block_means_what_it_means_in_verl(tmp_path):
    """A rollout_correction block as a verl 0.9.1 user writes it (asymmetric k1 bounds, quoted)."""
    from hpcrl.config import load_config

    path = tmp_path / "verl.yaml"
    path.write_text("async_training:\n  compute_prox_log_prob: true\n"
                    "algorithm:\n"
                    "  rollout_correction:\n"
                    "    rollout_is: token\n"
                    "    rollout_is_threshold: 2.0\n"
                    "    rollout_is_batch_normalize: false\n"
                    "    rollout_rs: seq_mean_k1\n"
                    "    rollout_rs_threshold: \"0.7_1.1\"\n")
    rc = load_config(path).algorithm.rollout_correction
    assert rc.rollout_rs == "seq_mean_k1" and rc.rollout_rs_threshold == "0.7_1.1"
    behav = torch.zeros(2, 3)
    prox = torch.tensor([[LOG(1.0), LOG(2.4), LOG(1.0)], [LOG(0.9), LOG(1.1), LOG(0.58)]])
    w, keep, s = correct(torch.ones(2, 3), prox_logp=prox, behav_logp=behav, rollout_is=rc.rollout_is,
                         rollout_is_threshold=rc.rollout_is_threshold, rollout_rs=rc.rollout_rs,
                         rollout_rs_threshold=rc.rollout_rs_threshold)
    # verl keeps a sequence with exp(mean_t log(mu / pi_prox)) in [0.7, 1.1]: 0.747 yes, 1.203 no
    torch.testing.assert_close(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 1.0], [0.9, 1.1, 0.58]]))


def test_correct_combines_is_rejection_veto_and_lag_masks_and_reports_fractions():
    behav = torch.zeros(3, 2)
    prox = torch.tensor([[LOG(3.0), 0.0], [LOG(1e-5), 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    lag = torch.tensor([[0, 0], [0, 0], [2, 0]])
    w, loss_mask, s = correct(mask, prox_logp=prox, behav_logp=behav, token_lag=lag, rollout_is="token",
                              rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=5.0,
                              rollout_token_veto_threshold=1e-4, max_token_lag=1)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0], [1e-5, 1.0], [1.0, 0.0]]))
    # row 1: 1/rho = 1e5 is above the RS upper bound 5 and rho below the veto -> the whole sequence goes
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
                      token_lag=torch.zeros(2, 2, dtype=torch.long), rollout_is="sequence", rollout_rs="seq_mean_k1",
                      rollout_rs_threshold=2.0, max_token_lag=0)
    assert torch.all(w == 0) and torch.all(m == 0)
    assert all(math.isfinite(v) for v in s.values())


def test_effective_sample_size_and_chi2_match_their_definitions():
    prox = torch.tensor([[LOG(0.5), LOG(2.0), LOG(1.0)], [LOG(4.0), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    _, _, s = correct(mask, prox_logp=prox, behav_logp=torch.zeros(2, 3), rollout_is="token",
                      rollout_is_threshold=3.0)
    w = torch.tensor([0.5, 2.0, 1.0, 3.0])  # truncated at 3
    assert abs(s["rollout_corr/rollout_is_eff_sample_size"] - float(1 / ((w / w.mean()) ** 2).mean())) < 1e-5
    rho = torch.tensor([0.5, 2.0, 1.0, 4.0])
    assert abs(s["rollout_corr/chi2_token"] - float((rho ** 2).mean() - 1)) < 1e-5
    assert abs(s["rollout_corr/chi2_seq"] - ((0.5 * 2.0 * 1.0) ** 2 + 4.0 ** 2) / 2 + 1) < 1e-5
    _, _, same = correct(mask, prox_logp=torch.zeros(2, 3), behav_logp=torch.zeros(2, 3), rollout_is="token")
    assert abs(same["rollout_corr/rollout_is_eff_sample_size"] - 1) < 1e-6 and same["rollout_corr/chi2_token"] == 0


@pytest.mark.parametrize("level, want", [
    ("token", [[0.5, 2.0, 1.0], [3.0, 0.0, 0.0]]),   # token mean 6.5/4
    ("sequence", [[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]]),  # sequence weights 1 and 3 (truncated), mean 2
])
def test_batch_normalized_weights_average_one(level, want):
    prox = torch.tensor([[LOG(0.5), LOG(2.0), LOG(1.0)], [LOG(4.0), 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w, _ = importance_weights(prox, mask, level, threshold=3.0, batch_normalize=True)
    mean = 6.5 / 4 if level == "token" else 2.0
    torch.testing.assert_close(w, torch.tensor(want) / mean)
