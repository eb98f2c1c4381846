"""A short seeded fault campaign (bench/soak.py): one run killed at the instants a checkpoint, a
publish, a shard commit and a weight load begin; every check of the campaign holds. (Damaged
shards: tests/test_faults.py; the in-suite budget keeps this to one ~70 s trial.)

The long campaign is run by hand: ``.venv/bin/python bench/soak.py --trials 90 --seed 7``.
"""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind, seed", [("instants", 3)])
def test_soak_trial(tmp_path, kind, seed):
    trial = soak.run_trial(0, kind, random.Random(seed), tmp_path, deadline_s=240)
    assert trial.ok, f"{kind} trial failed: {trial.problems} (kills {trial.kills})"
    if kind == "instants":
        assert sum(trial.kills.values()) >= 3, f"the fault points must be reached: {trial.kills}"
