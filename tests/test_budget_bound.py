"""The budget-aware bound (hpcrl/analysis/budget_bound.py) and the admission budget it rests on, against
verl 0.9.1's fully_async rule, by hand-computed values and against the planner's event simulation."""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from hpcrl.analysis.budget_bound import BudgetChain, Link, links, order_statistic_mean
from hpcrl.config import load_config
from hpcrl.control.admission import Admission
from hpcrl.rundir.paths import RunDir

SIM = "configs/simulated.yaml"


def verl_max_required_samples(ppo_mini_batch_size: int, require_batches: int, s: float, trigger: int) -> int:
    """verl 0.9.1 FullyAsyncRollouter.set_max_required_samples, verbatim arithmetic."""
    required_samples = ppo_mini_batch_size * require_batches
    return int(required_samples * (s + 1) * trigger)


@pytest.mark.parametrize("mini,req,s,K", [(4, 1, 0.0, 1), (4, 1, 0.5, 1), (4, 1, 1.0, 1), (32, 1, 0.5, 1),
                                          (8, 2, 0.5, 3), (16, 1, 0.3, 4), (128, 1, 0.1, 1), (64, 2, 1.0, 2)])
def test_budget_is_verls_max_required_samples(mini, req, s, K):
    """B counts groups (prompts with n responses), as verl's samples are: one RolloutSample per prompt."""
    cfg = load_config(SIM, ["rollout.total_rollout_steps=1024", f"actor.ppo_mini_batch_size={mini}",
                            f"actor.ppo_micro_batch_size={mini}",
                            f"async_training.require_batches={req}", f"async_training.staleness_threshold={s}",
                            f"async_training.trigger_parameter_sync_step={K}"])
    assert cfg.admission_budget == verl_max_required_samples(mini, req, s, K)


def test_budget_is_the_exact_product_where_verls_float_truncates():
    """verl truncates the float product: R=3, K=5, s=0.4 gives int(20.999999999999996) = 20 where the rule
    says 21. hpcrl takes the exact product (one group more, never less)."""
    assert verl_max_required_samples(3, 1, 0.4, 5) == 20
    cfg = load_config(SIM, ["actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size=3",
                            "async_training.staleness_threshold=0.4", "async_training.trigger_parameter_sync_step=5"])
    assert cfg.admission_budget == math.floor((1 + Fraction("0.4")) * 5 * 3) == 21


def test_starts_per_version_follow_verls_reset_of_the_stale_count(tmp_path):
    """verl: staleness_samples += 1 per start, pause at >= max_required_samples; at each parameter sync it is
    reset to (in flight + queued, unconsumed). hpcrl's single inequality gives the same starts. B=6, R=4."""
    rd = RunDir(tmp_path).create()
    adm = Admission(rd, "w000", budget=6)
    adm.join(0, set())
    starts = lambda consumed: sum(1 for _ in iter(lambda: adm.try_start(consumed), None))  # noqa: E731
    assert starts(0) == 6          # version 0: verl starts 6 (stale count 0 -> 6)
    # the trainer consumed 4 and published version 1; 2 carried over (verl: reset to 2) -> 4 more starts
    assert starts(4) == 4
    # version 2 with nothing consumed since (K=2: no new version would come; a republish) -> none
    assert starts(4) == 0
    assert starts(8) == 4          # version 2 after 8 consumed: 2 carried over again


def test_links_by_hand():
    assert links(1, 4, 4) == [Link(2, 1, 1, 4)]             # on-policy: all R groups after each load
    assert links(1, 4, 6) == [Link(2, 1, 1, 2)]             # s=0.5: half a batch ahead
    assert links(1, 4, 8) == [Link(3, 2, 1, 4)]             # s=1: the chain spans two updates
    # K=2, s=0: update 3 needs version 1 (after update 2) and 4 new groups, then update 4 follows;
    # update 4 needs all 8 groups started at that load
    assert links(2, 4, 8) == [Link(3, 2, 2, 4), Link(4, 2, 1, 8)]
    assert links(2, 4, 12) == [Link(4, 2, 1, 4), Link(5, 4, 2, 8)]
    with pytest.raises(ValueError, match="B >= K"):
        links(2, 4, 7)


def test_order_statistic_mean_by_enumeration():
    values = [1.0, 2.0, 4.0, 7.0]
    for k in (1, 2, 3):
        draws = [sorted(c) for c in itertools.product(values, repeat=k)]
        for n in range(1, k + 1):
            assert order_statistic_mean(values, n, k) == pytest.approx(np.mean([d[n - 1] for d in draws]))


def test_chain_step_by_hand():
    ch = BudgetChain(K=1, R=4, B=6, publish_s=0.5, switch_s=1.0, update_s=2.0, group_latencies_s=[3.0] * 10)
    assert ch.per_update_s == pytest.approx(0.5 + 1.0 + 3.0 + 2.0)
    s1 = BudgetChain(K=1, R=4, B=8, publish_s=0.5, switch_s=1.0, update_s=2.0, group_latencies_s=[3.0] * 10)
    assert s1.per_update_s == pytest.approx(6.5 / 2) and "over 2 updates" in s1.describe()


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("s,partial", [(0.0, False), (0.5, False), (0.5, True), (1.0, False), (1.0, True)])
def test_chain_against_the_planners_event_simulation(jobs, s, partial):
    """On the planner's own phase times (no control-plane latency) the chain is never more than a few per cent
    above the simulated step (it is an expectation), and where the budget binds (s < 1) it is the step."""
    from plan_reference import Knobs, predict

    sim = load_config(SIM).simulated
    k = Knobs(rollout_jobs=jobs, trainer_gpus=1, staleness_threshold=s, partial_rollout=partial,
              response_length=1536)
    p = predict(sim, k, 24)
    ch = BudgetChain(1, 4, k.budget, sim.publish_s, sim.weight_load_s, sim.update_model_s(p.tokens / p.updates),
                     p.group_latencies_s)
    assert ch.per_update_s <= 1.04 * p.step_s
    if s < 1:
        assert ch.per_update_s >= 0.96 * p.step_s
