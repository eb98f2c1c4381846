"""Policy / value losses and their aggregation against the definitions on hand-made tensors."""
import math

import pytest
import torch

from hpcrl.config.names import LOSS_AGG_MODES
from hpcrl.trainer.losses import agg_counts, agg_loss, entropy_from_logp, ppo_policy_loss, value_loss


def pg(logp, old, adv, mask, **kw):
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.2)
    return ppo_policy_loss(logp, old, adv, mask, **kw)


def test_ppo_clip_gradient_is_zero_outside_the_clip_range_for_the_right_sign():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, _ = pg(logp, old, adv, torch.ones(1, 4), clip_ratio_c=None)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0 and g[1] == 0, "clipped side: A>0 with ratio>1+eps, A<0 with ratio<1-eps"
    assert g[2] != 0 and g[3] != 0, "pessimistic side keeps the gradient"
    # value: mean of max(-A r, -A clip(r))
    want = (-1.2 + 0.8 + 1.5 - 0.5) / 4
    assert abs(loss.item() - want) < 1e-6


def test_asymmetric_clip_uses_low_and_high_separately():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = pg(logp, old, adv, torch.ones(1, 2), clip_low=0.3, clip_high=0.28, clip_ratio_c=None)
    loss.backward()
    # 1.25 < 1 + 0.28 and 0.75 > 1 - 0.3: neither token is clipped
    assert torch.all(logp.grad != 0)
    assert abs(loss.item() - (-1.25 + 0.75) / 2) < 1e-6


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_large_ratios():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, s = pg(logp, old, adv, torch.ones(1, 3), clip_ratio_c=3.0)
    loss.backward()
    g = logp.grad[0]
    assert g[0] == 0, "A<0 and ratio > c: the loss is the constant -A*c"
    assert g[1] != 0, "A<0 and 1+eps < ratio < c: plain PPO keeps the gradient"
    assert g[2] == 0, "A>0 and ratio > 1+eps: clipped"
    assert abs(loss.item() - (3.0 + 2.0 - 1.2) / 3) < 1e-6
    assert abs(s["actor/pg_clipfrac_lower"] - 1 / 3) < 1e-6
    without, _ = pg(logp.detach(), old, adv, torch.ones(1, 3), clip_ratio_c=None)
    assert abs(without.item() - (5.0 + 2.0 - 1.2) / 3) < 1e-6


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_contribute_nothing(mode):
    torch.manual_seed(0)
    logp = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0.0]])
    adv = torch.randn(2, 3)
    loss, _ = pg(logp, logp.detach() + 0.05, adv, mask, mode=mode)
    loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    # changing a masked token's inputs (even to huge values) does not change the loss
    logp2 = logp.detach().clone()
    logp2[mask == 0] = 50.0
    adv2 = adv.clone()
    adv2[mask == 0] = 1e6
    loss2, _ = pg(logp2, logp.detach() + 0.05, adv2, mask, mode=mode)
    assert abs(loss.item() - loss2.item()) < 1e-6


def test_aggregation_modes_match_their_formulas():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0.0]])  # the third sequence has no token
    assert agg_counts(mask) == (4, 2)
    assert abs(agg_loss(loss, mask, "token-mean").item() - (1 + 2 + 3 + 4) / 4) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum").item() - (6 + 4) / 2) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-mean").item() - (2 + 4) / 2) < 1e-6
    assert abs(agg_loss(loss, mask, "token-sum").item() - (1 + 2 + 3 + 4)) < 1e-6
    # Dr. GRPO's constant: (1 / (|S| H)) sum; H defaults to the padded length L = 3
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm").item() - (6 + 4) / 2 / 3) < 1e-6
    assert abs(agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=8).item() - (6 + 4) / 2 / 8) < 1e-6
    with pytest.raises(ValueError, match="token-sum"):
        agg_loss(loss, mask, "token-max")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_add_up_to_the_mini_batch_loss(mode):
    torch.manual_seed(1)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[4] = 0
    whole = agg_loss(loss, mask, mode)
    counts = agg_counts(mask)
    parts = sum(agg_loss(loss[i:i + 2], mask[i:i + 2], mode, *counts) for i in range(0, 6, 2))
    assert abs(whole.item() - parts.item()) < 1e-5


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_an_empty_mask_gives_zero_loss_and_no_nan(mode):
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, s = pg(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), mode=mode)
    loss.backward()
    assert loss.item() == 0 and torch.all(logp.grad == 0)
    assert all(math.isfinite(v) for v in s.values())


def test_importance_weights_scale_each_token_and_carry_no_gradient():
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0]])
    loss, _ = pg(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), weights=w)
    loss.backward()
    assert abs(loss.item() - (-(2.0 + 0.5) / 2)) < 1e-6
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))
    assert w.grad is None


def test_entropy_matches_its_definition():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.5, -1.0, 0.0]])
    logp = torch.log_softmax(logits, -1)
    h = entropy_from_logp(logp)
    assert abs(h[0].item() - math.log(4)) < 1e-6
    p = torch.softmax(logits[1], -1)
    assert abs(h[1].item() - float(-(p * p.log()).sum())) < 1e-6


def test_value_loss_is_the_larger_of_the_clipped_and_unclipped_errors():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    v = torch.tensor([[1.0, 0.3, -1.0]], requires_grad=True)
    ret = torch.tensor([[2.0, 0.4, 0.0]])
    loss, s = value_loss(v, old, ret, torch.ones(1, 3), cliprange_value=0.5)
    loss.backward()
    # token 0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25, clipped branch: no gradient
    # token 1: inside the clip range -> (0.3-0.4)^2
    # token 2: unclipped (-1)^2=1, clipped (-0.5)^2=0.25 -> 1, gradient kept
    want = 0.5 * (2.25 + 0.01 + 1.0) / 3
    assert abs(loss.item() - want) < 1e-6
    assert v.grad[0, 0] == 0 and v.grad[0, 1] != 0 and v.grad[0, 2] != 0
    assert abs(s["critic/vf_clipfrac"] - 1 / 3) < 1e-6


def test_vf_clipfrac_counts_no_value_inside_the_clip_range():
    # old + clamp(v - old, -c, c) gives -0.30000000000000004 for v=-0.3, old=0.1, c=0.5, whose error
    # to the return 0 is larger than that of v itself: it was counted as clipped though it is not
    v = torch.tensor([[-0.3, 0.7, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    loss, s = value_loss(v, old, ret, torch.ones(1, 3), cliprange_value=0.5)
    # range [old - c, old + c] = [-0.4, 0.6]: token 0 is inside; token 1 (0.7) clips to 0.6, whose
    # error (0.6-1)^2 = 0.16 > (0.7-1)^2 = 0.09 counts; token 2 (-0.5) clips to -0.4: 0.16 < 0.25, no
    assert abs(s["critic/vf_clipfrac"] - 1 / 3) < 1e-6
    want = 0.5 * (0.09 + 0.16 + 0.25) / 3
    assert abs(loss.item() - want) < 1e-12
    loss.backward()
    assert v.grad[0, 0] != 0 and v.grad[0, 1] == 0 and v.grad[0, 2] != 0
