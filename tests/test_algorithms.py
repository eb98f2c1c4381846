"""Each advantage estimator learns the toy task end to end (real trainer and rollout jobs).

GRPO is covered by the tiny default run (test_learning.py). Each run here also turns
on one or two loss options so that every code path of the update runs in CI:
KL loss and seq-mean-token-mean (rloo), entropy bonus (reinforce_plus_plus),
seq-mean-token-sum (reinforce_plus_plus_baseline), the critic with an adaptive
reward KL against the frozen reference (gae). 400 groups = 100 updates (~40 s each).
"""
import pytest

from conftest import start_rollout, start_trainer
from hpcrl.logs import read_metrics
from test_learning import fifths

RUNS = {
    "rloo": ["actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl", "actor.loss_agg_mode=seq-mean-token-mean"],
    "reinforce_plus_plus": ["actor.entropy_coeff=0.001"],
    "reinforce_plus_plus_baseline": ["actor.loss_agg_mode=seq-mean-token-sum"],
    "gae": ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"],
}


@pytest.mark.parametrize("estimator", list(RUNS))
def test_estimator_learns_the_toy_task(tiny_run, estimator):
    rd = tiny_run(f"algorithm.adv_estimator={estimator}", "rollout.total_rollout_steps=400", *RUNS[estimator])
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    m = read_metrics(rd)
    assert len(m) == 100
    first, last = fifths(m["reward/mean"].to_numpy())
    print(f"{estimator}: reward first fifth {first:.3f}, last fifth {last:.3f}")
    assert last > first + 0.15, f"{estimator}: reward did not rise: first fifth {first:.3f}, last fifth {last:.3f}"
    assert m["actor/grad_norm"].gt(0).all()
    if estimator == "gae":
        assert m["critic/vf_loss"].notna().all() and m["critic/values/mean"].iloc[-1] > 0.05, "the critic learns"
        kl = m["actor/reward_kl_penalty"].to_numpy()
        assert kl[-1] > kl[0], "the policy moves away from the frozen reference"
        assert m["actor/reward_kl_penalty_coeff"].nunique() > 1, "the adaptive controller moves beta"
    if estimator == "rloo":
        assert m["actor/kl_loss"].iloc[-1] > 0
