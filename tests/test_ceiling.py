"""The ideal-overlap bound of hpcrl report, on hand-made logs whose answer is known."""
from __future__ import annotations

import pandas as pd
import pytest

from hpcrl import metric_names as M
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
