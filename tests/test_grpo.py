"""GRPO advantages and the PPO clip loss against their definitions on hand-made tensors."""
import torch

from hpcrl.trainer.grpo import grpo_advantages, ppo_clip_loss


def test_grpo_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = grpo_advantages(r, g, norm_by_std=True)
    for k in (0, 1):
        sel = g == k
        assert abs(float(a[sel].mean())) < 1e-6
        assert abs(float(a[sel].std()) - 1.0) < 1e-4
    a_raw = grpo_advantages(r, g, norm_by_std=False)
    torch.testing.assert_close(a_raw[:3], r[:3] - r[:3].mean())


def test_grpo_equal_rewards_and_group_of_one_give_zero():
    a = grpo_advantages(torch.tensor([2.0, 2.0, 5.0]), torch.tensor([0, 0, 1]), norm_by_std=True)
    torch.testing.assert_close(a, torch.zeros(3))


def test_ppo_clip_gradient_is_zero_outside_the_clip_range():
    old = torch.zeros(4)
    # ratios 1.5 (above 1+eps) and 0.5 (below 1-eps) for positive / negative advantages
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(4), clip_ratio=0.2, n_tokens_total=4)
    loss.backward()
    g = logp.grad
    assert g[0] == 0 and g[1] == 0, "clipped side: A>0 with ratio>1+eps, A<0 with ratio<1-eps"
    assert g[2] != 0 and g[3] != 0, "pessimistic side keeps the gradient"


def test_masked_tokens_contribute_nothing():
    logp = torch.randn(6, requires_grad=True)
    mask = torch.tensor([1, 1, 0, 0, 1, 0.0])
    loss, _ = ppo_clip_loss(logp, logp.detach(), torch.ones(6), mask, 0.2, n_tokens_total=3)
    loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    # at ratio 1 the loss is -mean(A) over the 3 unmasked tokens
    assert abs(loss.item() + 1.0) < 1e-6
