"""The ideal-overlap bound of hpcrl report, on hand-made logs whose answer is known."""
from __future__ import annotations

import pandas as pd
import pytest

from hpcrl.logs import metric_names as M
from hpcrl.analysis.ceiling import ceiling


def _metrics(update_s=2.0, sync_s=0.5):
    return pd.DataFrame({M.STEP: [1, 2, 3], M.TIME_S: [10.0, 20.0, 30.0], M.UPDATE_S: [update_s] * 3,
                         M.PARAM_SYNC_S: [sync_s] * 3, M.N_TOKENS: [100] * 3})


def _rollout(writer="w000", idle=0.2, load_s=1.0):
    return pd.DataFrame({M.WRITER: [writer] * 3, M.TIME_S: [10.0, 20.0, 30.0], M.WALL_S: [10.0] * 3,
                         M.ROLLOUT_IDLE_RATIO: [idle] * 3, M.LOAD_WEIGHTS_S: [load_s] * 3})


def test_rollout_bound_run():
    c = ceiling(_metrics(), _rollout())
    # window (10, 30]: rows 2 and 3 busy 8 s each, row 2's holding the load of version 3 (rows are written
    # after the next load); the trainer 2 x (2 + 0.5)
    assert (c.generation_s, c.switch_s, c.update_s, c.publish_s) == pytest.approx((15.0, 1.0, 4.0, 1.0))
    assert c.bound_s == pytest.approx(16.0) and c.measured_s == pytest.approx(20.0)
    assert c.ratio == pytest.approx(0.8) and c.limited_by == "rollout" and c.tokens == 200
    assert "0.80" in c.line()


def test_two_writers_share_the_generation():
    c = ceiling(_metrics(update_s=9.0), pd.concat([_rollout("w000"), _rollout("w001")]))
    assert c.generation_s == pytest.approx(15.0) and c.switch_s == pytest.approx(1.0)
    assert c.limited_by == "trainer" and c.bound_s == pytest.approx(19.0)


def test_a_row_half_inside_the_window_counts_half():
    ro = _rollout()
    ro[M.TIME_S] = [15.0, 25.0, 35.0]  # rows [5,15], [15,25], [25,35]: inside [10,30] 5 + 10 + 5 s
    c = ceiling(_metrics(), ro, rollout_jobs=1)
    assert c.generation_s == pytest.approx(0.5 * 7 + 7 + 0.5 * 8)


def test_no_bound_with_one_update():
    assert ceiling(_metrics().iloc[:1], _rollout()) is None


def test_speedup_over_an_on_policy_baseline_and_its_ceiling():
    from hpcrl.analysis.ceiling import speedup_line

    base = ceiling(_metrics(), _rollout())                      # 2 updates in 20 s
    fast = ceiling(_metrics().assign(**{M.TIME_S: [10.0, 15.0, 20.0]}), _rollout(idle=0.5))
    line = speedup_line("b", fast, "a", base)
    assert "2.00x the step rate of a" in line  # 10 s per update -> 5 s
    assert f"at most {10.0 / (fast.bound_s / 2):.2f}x" in line


def _staleness(latency_s=6.0, steps=(1, 2, 3), groups_per_step=4):
    rows = [{"group_id": f"w000/{s * 10 + g}", "trainer_step": s, "created_s": 100.0 * s, "finished_s": 100.0 * s + latency_s}
            for s in steps for g in range(groups_per_step)]
    return pd.DataFrame(rows)


def test_budget_aware_bound_next_to_the_ideal_one():
    """On-policy (K=1, R=4, B=4): per update publish 0.5 + switch 0.5 (the window's 1.0 over its 2 versions) +
    the slowest of 4 groups (6 s each) + update 2 = 9 s; 2 updates -> 18 s, above the ideal 16 s."""
    c = ceiling(_metrics(), _rollout(), staleness=_staleness(), budget=(1, 4, 4))
    assert c.bound_s == pytest.approx(16.0) and c.ratio == pytest.approx(0.8)  # the ideal bound is unchanged
    assert c.budget.per_update_s == pytest.approx(9.0)
    assert c.budget_bound_s == pytest.approx(18.0) and c.budget_ratio == pytest.approx(0.9)
    assert "budget-aware bound 18.0s" in c.line() and "slowest" not in c.line() and "4th fastest of 4" in c.line()


def test_budget_aware_bound_is_the_ideal_one_where_the_budget_has_room():
    """s=1 (B=8): the chain spans two updates, (0.5 + 0.5 + 6 + 2) / 2 = 4.5 s per update, under the ideal 8."""
    c = ceiling(_metrics(), _rollout(), staleness=_staleness(), budget=(1, 4, 8))
    assert c.budget.per_update_s == pytest.approx(4.5) and c.budget_bound_s == pytest.approx(c.bound_s)


def test_no_budget_bound_without_knobs_or_groups():
    assert ceiling(_metrics(), _rollout()).budget_bound_s is None
    assert ceiling(_metrics(), _rollout(), staleness=_staleness(steps=(1,)), budget=(1, 4, 4)).budget is None
    assert "budget" not in ceiling(_metrics(), _rollout()).line()


def test_the_recommendation_names_the_budget_where_it_sets_the_pace():
    """Budget-aware 18 s > 1.05 x ideal 16 s: the knob is staleness_threshold, the smallest (step 0.25) where the
    chain (here with equal latencies: 9 s up to s=0.75, 4.5 s from s=1) fits in the ideal 8 s per update."""
    from hpcrl.analysis.recommend import budget_binds

    class K:
        staleness_threshold = 0.0

    rec = budget_binds(0.5, 0.4, K, ceiling(_metrics(), _rollout(), staleness=_staleness(), budget=(1, 4, 4)))
    assert rec.bottleneck == "budget" and "trainer idle 0.50" in rec.line and "cannot beat 9.00s" in rec.line
    assert "hpcrl scale" not in rec.line and "rollout_jobs" not in rec.line, "another writer would not help"
    assert "staleness_threshold to 1 (B=8, lag bound 1 version(s)), where the chain allows 4.50s" in rec.line
    assert budget_binds(0.5, 0.4, K, ceiling(_metrics(), _rollout(), staleness=_staleness(), budget=(1, 4, 8))) is None
    assert budget_binds(0.5, 0.4, K, ceiling(_metrics(), _rollout())) is None


def test_speedup_names_the_budget_aware_ceiling_too():
    from hpcrl.analysis.ceiling import speedup_line

    base = ceiling(_metrics(), _rollout())                                       # 10 s per update
    run = ceiling(_metrics(), _rollout(), staleness=_staleness(), budget=(1, 4, 4))  # budget-aware 18 s / 2
    assert speedup_line("b", run, "a", base).endswith(f"its budget-aware bound {10.0 / 9.0:.2f}x")
