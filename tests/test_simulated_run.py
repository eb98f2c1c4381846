"""A tiny simulated run end to end: the real trainer loop (its update slept) and a rollout job on the simulated
engine, through the real run directory: exactly-once, the simulated names in logs and report, the bound."""
from __future__ import annotations

import json

import pytest

from conftest import check_exactly_once
from hpcrl.logs import metric_names as M

SIMULATED = ["rollout.engine=simulated", "trainer.simulated=true", "eval.every_versions=0",
             "simulated.time_scale=50", "simulated.lengths=geometric", "simulated.length_mean=30",
             "simulated.update_base_s=2.0", "simulated.weight_load_s=1.0", "rollout.response_length=96",
             "rollout.total_rollout_steps=24", "rollout.max_concurrent_groups=4",
             "async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
             "trainer.checkpoint_every_updates=3", "simulated.publish_s=5.0"]

BACKGROUND_RUNS = {"simulated:run": SIMULATED}
"""The run the end-to-end test reads, in the background when the session starts (conftest.BackgroundRuns): what it
asserts of the modelled times are lower bounds, which a starved run meets too."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads (none: it runs its own jobs)."""
    return ("simulated:run",) if item.originalname == "test_simulated_run_is_exactly_once_and_says_simulated" else ()


@pytest.mark.slow
def test_simulated_run_is_exactly_once_and_says_simulated(background_runs, tmp_path):
    rd = background_runs.finish("simulated:run")
    check_exactly_once(rd, max_in_flight=4)
    rows = [json.loads(x) for x in rd.metrics.read_text().splitlines()]
    assert len(rows) == 6
    # the update slept its modelled time / time_scale (2 s + 0.0005 s/token) / 50
    for r in rows:
        assert r[M.SIMULATED_UPDATE_MODEL_S] == pytest.approx(2.0 + 0.0005 * r[M.N_TOKENS])
        assert r[M.UPDATE_S] >= r[M.SIMULATED_UPDATE_MODEL_S] / 50 * 0.9
    # every update published: the modelled publish (5 s / 50) is inside the trainer's param_sync
    assert all(r[M.PARAM_SYNC_S] >= 0.1 * 0.9 for r in rows)
    for job in ("trainer", "rollout-w000"):
        lines = [x for x in rd.job_log(job).read_text().splitlines() if x[:2] == "20"]
        assert lines and all(f"{job} [simulated]" in x for x in lines)
    from hpcrl.analysis.report import build_report

    text = build_report([rd.root], tmp_path / "report").markdown.read_text()
    assert "SIMULATED engine and trainer" in text and "time_scale 50" in text
    assert "ideal overlap bound" in text and "measured / bound throughput" in text
    assert "budget-aware bound" in text  # the admission budget (B=8 at s=1) next to it
