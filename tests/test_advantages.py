"""Advantage estimators against their definitions on hand-made tensors, edge cases included."""
import pytest
import torch

from hpcrl.config.registries import ADV_ESTIMATORS
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.trainer.advantages import compute_advantages, masked_whiten, place_scores
from hpcrl.trainer.estimators import discounted_returns, gae, gdpo, grpo, rloo
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.pf_ppo import pf_ppo_indices, pf_ppo_weights
from hpcrl.trainer.token_baseline import score_norm_sq

GROUP_ESTIMATORS = tuple(name for name, spec in ADV_ESTIMATORS.items() if spec.group)


def reference_discounted(r, mask, gamma):
    """Loop form of the definition: R_t = sum over later mask-1 steps k of gamma^(steps) r_k."""
    B, L = r.shape
    out = torch.zeros(B, L)
    for b in range(B):
        steps = [t for t in range(L) if mask[b, t] > 0]
        for i, t in enumerate(steps):
            out[b, t] = sum(gamma ** j * r[b, k] for j, k in enumerate(steps[i:]))
    return out


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    torch.manual_seed(0)
    r = torch.randn(3, 5)
    v = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    r = r * mask
    for gamma in (1.0, 0.9):
        adv, ret = gae(r, v, mask, gamma=gamma, lam=1.0)
        want = (reference_discounted(r, mask, gamma) - v) * mask
        torch.testing.assert_close(adv, want)
        torch.testing.assert_close(ret, (adv + v) * mask)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.2, 0.5, 0.7]])
    mask = torch.ones(1, 3)
    adv, _ = gae(r, v, mask, gamma=0.9, lam=0.0)
    want = torch.tensor([[0.0 + 0.9 * 0.5 - 0.2, 0.0 + 0.9 * 0.7 - 0.5, 1.0 + 0.0 - 0.7]])
    torch.testing.assert_close(adv, want)


def test_gae_skips_tool_tokens_instead_of_stepping_over_them():
    """A mask-0 token in the middle is not a step: the tokens around it chain directly."""
    r = torch.tensor([[0.0, 5.0, 1.0]])  # the 5.0 on the tool token must be ignored
    v = torch.tensor([[0.3, 9.0, 0.6]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = gae(r * mask, v, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5 * 1.0 - 0.3, 0.0, 1.0 - 0.6]]))


def test_place_scores_puts_the_score_on_the_last_model_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    tr = place_scores(torch.tensor([1.0, 2.0, 3.0]), mask)
    torch.testing.assert_close(tr, torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 2.0], [0, 0, 0, 0]]))


def test_grpo_is_zero_mean_within_each_group_and_unit_std_when_normalised():
    s = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = grpo(s, g, norm_by_std=True)
    for k in (0, 1):
        assert abs(float(a[g == k].mean())) < 1e-6
        assert abs(float(a[g == k].std()) - 1.0) < 1e-4
    torch.testing.assert_close(grpo(s, g, norm_by_std=False)[:3], s[:3] - s[:3].mean())


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_equal_rewards_and_a_group_of_one_give_zero(norm):
    a = grpo(torch.tensor([2.0, 2.0, 5.0]), torch.tensor([0, 0, 1]), norm_by_std=norm)
    torch.testing.assert_close(a, torch.zeros(3))


def test_rloo_uses_the_leave_one_out_mean():
    s = torch.tensor([1.0, 0.0, 0.5, 0.25, 4.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = rloo(s, g)
    for i in range(6):
        others = [float(s[j]) for j in range(6) if g[j] == g[i] and j != i]
        assert abs(float(a[i]) - (float(s[i]) - sum(others) / len(others))) < 1e-6
    # the closed form n/(n-1) * (s - mean)
    torch.testing.assert_close(a[:4], 4 / 3 * (s[:4] - s[:4].mean()))


def test_rloo_equal_rewards_and_a_group_of_one_give_zero():
    torch.testing.assert_close(rloo(torch.tensor([0.3, 0.3, 0.3, 7.0]), torch.tensor([0, 0, 0, 1])), torch.zeros(4))


def test_reinforce_plus_plus_whitens_the_discounted_return_over_the_batch():
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    tr = place_scores(torch.tensor([1.0, 0.0, 0.5]), mask)
    adv, ret = compute_advantages("reinforce_plus_plus", tr, mask, torch.tensor([0, 0, 1]), gamma=0.9)
    torch.testing.assert_close(ret, reference_discounted(tr, mask, 0.9))
    torch.testing.assert_close(ret, discounted_returns(tr, mask, 0.9))
    sel = adv[mask > 0]
    assert abs(float(sel.mean())) < 1e-6 and abs(float(sel.std()) - 1.0) < 1e-4
    assert torch.all(adv[mask == 0] == 0)


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens():
    mask = torch.ones(4, 2)
    s = torch.tensor([1.0, 0.0, 0.2, 0.6])
    g = torch.tensor([0, 0, 1, 1])
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", place_scores(s, mask), mask, g)
    centred = torch.tensor([0.5, -0.5, -0.2, 0.2])[:, None].expand(4, 2)
    torch.testing.assert_close(adv, masked_whiten(centred, mask))


def inputs(B: int, L: int) -> dict:
    """What the estimators beyond scores and masks read: optimal token baselines' score norms, remax's baselines."""
    return {"w_token": torch.linspace(0.2, 1.0, B * L).reshape(B, L), "reward_baselines": torch.full((B,), 0.25)}


@pytest.mark.parametrize("est", ADV_ESTIMATORS)
def test_estimators_broadcast_to_model_tokens_only_and_survive_an_empty_mask(est):
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.float32)
    s = torch.tensor([1.0, 0.0, 0.7, 0.3])
    g = torch.tensor([0, 0, 1, 1])
    values = torch.full((4, 3), 0.1)
    adv, ret = compute_advantages(est, place_scores(s, mask), mask, g, values=values, **inputs(4, 3))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[mask == 0] == 0), "masked tokens get no advantage"
    assert torch.all(adv[2] == 0), "a trajectory with no model token gets nothing"
    if est in ("grpo", "rloo"):
        assert float(adv[0, 0]) > 0 > float(adv[1, 0]) and adv[0, 0] == adv[0, 1]


@pytest.mark.parametrize("est", GROUP_ESTIMATORS)
@pytest.mark.parametrize("score", [0.5, 0.3, 0.6])
def test_all_equal_rewards_give_no_signal(est, score):
    # 0.3 and 0.6 are not exact in float32: eight of them averaged in float32 miss the value by a
    # rounding step and have a std of ~6e-8, which grpo's 1 / (std + 1e-6) turned into +0.056 on
    # every response of the group (what verl computes); the group statistics are float64 here
    mask = torch.ones(16, 3)
    adv, _ = compute_advantages(est, place_scores(torch.full((16,), score), mask), mask,
                                torch.arange(16) // 8, **inputs(16, 3))
    assert torch.all(adv.abs() < 1e-6), f"{est}: {adv.abs().max()}"


def test_whiten_of_fewer_than_two_tokens_is_zero_not_nan():
    assert torch.all(masked_whiten(torch.tensor([[3.0, 1.0]]), torch.tensor([[1.0, 0.0]])) == 0)
    assert torch.all(masked_whiten(torch.zeros(2, 2), torch.zeros(2, 2)) == 0)


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="grpo_passk"):
        compute_advantages("remax2", torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([0, 0]))


@pytest.mark.parametrize("alias, name", [("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")])
def test_verls_vectorized_names_are_aliases(alias, name):
    mask, g = torch.ones(4, 2), torch.tensor([0, 0, 1, 1])
    tr = place_scores(torch.tensor([1.0, 0.2, 0.5, 0.7]), mask)
    torch.testing.assert_close(compute_advantages(alias, tr, mask, g)[0], compute_advantages(name, tr, mask, g)[0])


def test_opo_subtracts_the_length_weighted_group_mean():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    s = torch.tensor([1.0, 0.0, 0.4, 0.2])
    adv, ret = compute_advantages("opo", place_scores(s, mask), mask, torch.tensor([0, 0, 1, 1]))
    b0 = (3 * 1.0 + 1 * 0.0) / 4           # lengths 3 and 1
    b1 = (2 * 0.4 + 4 * 0.2) / 6           # lengths 2 and 4
    want = torch.tensor([1.0 - b0, 0.0 - b0, 0.4 - b1, 0.2 - b1])[:, None] * mask
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_rewards_only_the_best_by_its_margin_over_the_second(norm):
    mask = torch.ones(6, 2)
    s = torch.tensor([0.2, 0.9, 0.5, 0.3, 0.3, 0.1])
    adv, _ = compute_advantages("grpo_passk", place_scores(s, mask), mask, torch.tensor([0, 0, 0, 1, 1, 1]),
                                norm_adv_by_std_in_grpo=norm)
    a0 = 0.9 - 0.5
    a0 = a0 / (float(s[:3].std()) + 1e-6) if norm else a0
    want = torch.tensor([0.0, a0, 0.0, 0.0, 0.0, 0.0])  # group 1: a tie at the top gives margin 0
    torch.testing.assert_close(adv, want[:, None].expand(6, 2))


def test_gpg_scales_the_group_centred_score_by_batch_over_nonzero_scores():
    mask = torch.ones(4, 2)
    s = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one non-zero score of four: alpha = 4
    adv, _ = compute_advantages("gpg", place_scores(s, mask), mask, torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([2.0, -2.0, 0.0, 0.0])[:, None].expand(4, 2))


@pytest.mark.parametrize("est", ADV_ESTIMATORS)
def test_keep_removes_rejected_tokens_as_verl_rejection_does(est):
    """mask_before_advantages: rejected tokens get no advantage and are no steps; the trajectory
    scores (and so the group baselines) are those of the unrejected batch."""
    torch.manual_seed(0)
    mask = torch.ones(4, 3)
    keep = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.float32)
    s = torch.tensor([1.0, 0.0, 0.6, 0.2])
    g = torch.tensor([0, 0, 1, 1])
    values = torch.randn(4, 3)
    tr = place_scores(s, mask)
    adv, ret = compute_advantages(est, tr, mask, g, values=values, keep=keep, **inputs(4, 3))
    assert torch.all(adv[keep == 0] == 0)
    full, _ = compute_advantages(est, tr, mask, g, values=values, **inputs(4, 3))
    if est in ("grpo", "rloo", "grpo_passk", "gpg"):  # per-trajectory: the full batch's, masked
        torch.testing.assert_close(adv, full * keep)
    if est == "gae":  # row 2 steps over its rejected middle token: as if it were a tool token
        raw, want_ret = compute_advantages(est, tr, keep, g, values=values)
        torch.testing.assert_close(adv, raw)
        torch.testing.assert_close(ret, want_ret)
    if est == "opo":  # lengths are kept tokens: group 1 weights 2 and 3
        b1 = (2 * 0.6 + 3 * 0.2) / 5
        torch.testing.assert_close(adv[2:, 0], torch.tensor([0.6 - b1, 0.2 - b1]))


# ---- verl 0.9.1's later estimators: hand-computed on one group of two

def test_optimal_token_baseline_weights_each_steps_returns_by_the_accumulated_score_norm():
    # traj 0 scores 1, traj 1 scores 0; w_0 = [1, 2] -> W_0 = [1, 3], w_1 = [1, 1] -> W_1 = [1, 2]
    # B_0 = (1*1 + 0*1) / (1 + 1) = 0.5, B_1 = (1*3 + 0*2) / (3 + 2) = 0.6
    mask, g = torch.ones(2, 2), torch.tensor([0, 0])
    tr = place_scores(torch.tensor([1.0, 0.0]), mask)
    w = torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    adv, ret = compute_advantages("optimal_token_baseline", tr, mask, g, w_token=w)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4], [-0.5, -0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    # importance weights scale w by their square: w_0 = [1, 0.5] -> W_0 = [1, 1.5], B_1 = 1.5 / 3.5
    adv, _ = compute_advantages("optimal_token_baseline", tr, mask, g, w_token=w,
                                is_weights=torch.tensor([[1.0, 0.5], [1.0, 1.0]]))
    assert abs(float(adv[0, 1]) - (1 - 1.5 / 3.5)) < 1e-6


def test_optimal_token_baseline_zeroes_the_baseline_of_the_longest_trajectorys_tail():
    # traj 1 has one token: B_1 = (1*3) / 3 = 1 would take traj 0's whole return; no one else is there,
    # so the baseline of traj 0 is 0 from step 1 on (verl's handle_zero_tail)
    mask, g = torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 0])
    tr = place_scores(torch.tensor([1.0, 0.0]), mask)
    adv, _ = compute_advantages("optimal_token_baseline", tr, mask, g, w_token=torch.tensor([[1.0, 2.0], [1.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0], [-0.5, 0.0]]))


def test_tir_optimal_token_baseline_aligns_steps_by_model_token_not_position():
    # traj 0: model tokens at 0 and 2 (a tool token at 1); traj 1 at 0 and 1; w = 1
    # by model token: G = [1, 1] and [0, 0], W = [1, 2] both: B = [0.5, 0.5]
    # by position (optimal_token_baseline): B_2 = (1*2) / 2 = 1 (traj 1 has no token 2): A_02 = 0
    mask, g = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]), torch.tensor([0, 0])
    tr, w = place_scores(torch.tensor([1.0, 0.0]), mask), torch.ones(2, 3)
    tir, ret = compute_advantages("tir_optimal_token_baseline", tr, mask, g, w_token=w)
    torch.testing.assert_close(tir, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    pos, _ = compute_advantages("optimal_token_baseline", tr, mask, g, w_token=w)
    torch.testing.assert_close(pos, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]))


def test_score_norm_is_the_squared_norm_of_the_log_prob_gradient():
    logits = torch.tensor([[[0.3, -1.0, 2.0, 0.1]]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    logp[0, 0, 2].backward()
    w = score_norm_sq(logp.detach(), torch.tensor([[2]]))
    assert abs(float(w) - float(logits.grad.square().sum())) < 1e-6


def test_remax_subtracts_the_greedy_baseline_from_the_return():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tr = place_scores(torch.tensor([1.0, 0.0]), mask)
    adv, ret = compute_advantages("remax", tr, mask, torch.tensor([0, 1]), reward_baselines=torch.tensor([0.3, 0.3]))
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.7], [-0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="greedy"):
        compute_advantages("remax", tr, mask, torch.tensor([0, 1]))


def test_remax_takes_each_groups_greedy_reward_from_the_shard_groups_as_the_baseline():
    """build_batch spreads a group's reward_baseline over its trajectories, and remax subtracts it from the
    reward-to-go on model tokens (a tool token inside the response, mask 0, gets 0 and adds nothing)."""
    def traj(reward, mask):
        n = len(mask)
        return Trajectory(prompt_ids=[3, 4], response_ids=list(range(5, 5 + n)), response_mask=mask,
                          logprobs=[-1.0] * n, token_versions=[0] * n, reward=reward)

    groups = [Group("w000", 0, [traj(1.0, [1, 0, 1]), traj(0.0, [1, 1])], 0.0, 1.0, reward_baseline=0.6),
              Group("w000", 1, [traj(0.5, [1, 1, 1])], 0.0, 1.0, reward_baseline=0.5)]
    batch = build_batch(groups, pad_id=0, trainer_version=0)
    assert batch.reward_baselines.tolist() == pytest.approx([0.6, 0.6, 0.5])
    adv, ret = compute_advantages("remax", place_scores(batch.rewards, batch.mask), batch.mask, batch.group_index,
                                  reward_baselines=batch.reward_baselines)
    # by hand: 1.0 - 0.6 = 0.4 on the two model tokens; 0.0 - 0.6; 0.5 - 0.5 = 0 (the greedy answer was as good)
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.0, 0.4], [-0.6, -0.6, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]))
    groups[1].reward_baseline = None  # a group without one (a shard of a run without remax): no baselines at all
    assert build_batch(groups, pad_id=0, trainer_version=0).reward_baselines is None


def test_gdpo_with_one_reward_is_grpo_whitened_over_the_batch():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    s, g = torch.tensor([1.0, 0.0, 0.5, 0.1]), torch.tensor([0, 0, 1, 1])
    adv, ret = compute_advantages("gdpo", place_scores(s, mask), mask, g)
    # grpo: each group of two is (+-1/sqrt(2)) / std = +-0.70711 / 0.70711 -> +-1 (over std + 1e-6)
    a = 1 / (1 + 1e-6 / 0.70710678)
    grpo_tokens = torch.tensor([[a, a], [-a, 0.0], [a, a], [-a, -a]])
    torch.testing.assert_close(adv, masked_whiten(grpo_tokens, mask))
    torch.testing.assert_close(ret, adv)
    # two components, weighted: c_0 grpo(s) + c_1 grpo(s'), then whitened
    comps = torch.stack([s, torch.tensor([1.0, 0.0, 0.0, 1.0])], 1)  # grpo of the second: +a, -a, -a, +a
    two = gdpo(comps, g, mask, True, torch.tensor([1.0, 0.5]))
    summed = torch.tensor([[1.5 * a] * 2, [-1.5 * a, 0.0], [0.5 * a] * 2, [-0.5 * a] * 2]) * mask
    torch.testing.assert_close(two, masked_whiten(summed, mask))


def test_pf_ppo_weights_and_draws_follow_verls_methods():
    s = torch.tensor([0.5, -1.0, 0.0, 1.0])
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 2.0), torch.tensor([0.25, 1.0, 0.0, 1.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_min", 2.0), torch.tensor([0.0, 1.0, 0.0, 1.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_random", 2.0), torch.tensor([0.1, 0.1, 0.1, 0.4]) + 1e-8)
    rows = pf_ppo_indices(s.repeat(50), "max_min", 2.0, seed=7)
    assert len(rows) == 200 and set((rows % 4).tolist()) == {1, 3}, "only the highest and lowest scores are drawn"
    assert torch.equal(rows, pf_ppo_indices(s.repeat(50), "max_min", 2.0, seed=7)), "every rank draws the same rows"
    counts = torch.bincount(pf_ppo_indices(s.repeat(500), "max_random", 2.0, seed=1) % 4, minlength=4).float()
    assert abs(float(counts[3] / counts.sum()) - 0.4 / 0.7) < 0.03  # 0.4 / (0.4 + 3 * 0.1)
