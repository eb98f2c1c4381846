"""analysis/: the notebook that draws a run's staleness, lag, idle and validation views with the code in the
open, and the script that compares runs; both executed on a tiny run so they never rot."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, BackgroundCommand
from hpcrl.logs.eval_log import EVALUATED, read_eval_rows

pytestmark = pytest.mark.slow
NOTEBOOK = REPO / "analysis" / "runs.ipynb"


def tiny_launch(folder: Path) -> list[str]:
    """`hpcrl run configs/tiny.yaml` for 20 updates at s=0.5, launched like a user's."""
    return ["run", str(TINY), "rollout.total_rollout_steps=80", "async_training.staleness_threshold=0.5",
            "--run-dir", str(folder / "tiny"), "--executor", "local", "--timeout-min", "30"]


BACKGROUND_RUNS = {"nb:tiny": BackgroundCommand.hpcrl_args(tiny_launch)}
"""The run both tests read, in the background when the session starts (conftest.BackgroundRuns)."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads: the tiny run, for every test that takes it."""
    return ("nb:tiny",) if "tiny_run" in item.fixturenames else ()


@pytest.fixture(scope="module")
def tiny_run(background_runs):
    out = background_runs.launched("nb:tiny", timeout_s=900)
    assert out.returncode == 0, out.stdout[-3000:]
    return Path(out.args[out.args.index("--run-dir") + 1])


def test_the_notebook_runs_end_to_end_and_writes_its_figures(tiny_run, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    other = tmp_path / "no_eval"  # a second run without validation rows (eval.every_versions=0 writes none)
    shutil.copytree(tiny_run, other)
    (other / "logs" / "eval.jsonl").unlink()
    figures = tmp_path / "figures"
    monkeypatch.setenv("HPCRL_RUNS", f"{tiny_run}:{other}")
    monkeypatch.setenv("HPCRL_FIGURES", str(figures))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    for name in ("staleness.png", "lag.png", "idle.png", "validation.png"):
        data = (figures / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert (figures / "summary.csv").read_text().count("\n") == 3, "one row per run"
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tiny: finished" in printed and "no_eval: no logs/eval.jsonl" in printed, printed
    rows = read_eval_rows(tiny_run / "logs" / "eval.jsonl")
    assert sorted(r.version for r in rows) == [0, 20]  # tiny.yaml: v0, every 20th; 80 rollout steps = 20 updates
    evaluated = [r for r in rows if r.status == EVALUATED]  # one that fell behind skips (a row, not drawn)
    assert evaluated[-1].version == 20, rows
    assert (f"tiny: {len(evaluated)} evaluated versions, last {evaluated[-1].score_name} = "
            f"{evaluated[-1].score:.3f}") in printed, printed


def test_the_compare_script_prints_the_side_by_side_table_and_draws_the_curves(tiny_run, tmp_path):
    other = tmp_path / "tiny2"
    shutil.copytree(tiny_run, other)
    out = subprocess.run([sys.executable, str(REPO / "analysis" / "compare_runs.py"), str(tiny_run), str(other),
                          "--out", str(tmp_path / "cmp")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "tiny2" in out.stdout
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"compare_reward.png", "compare_lag.png",
                                                             "compare_idle.png", "compare_progress.png"}
