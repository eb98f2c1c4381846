"""Launch to first update: how long a user waits, from ``hpcrl run`` to the trainer's first update.

The README's first command (``hpcrl run configs/tiny.yaml --executor local``) is launched as a user
would; the time from launch to the first row of ``logs/metrics.jsonl`` is measured, then the run is
cancelled (SIGTERM to the launcher, which cancels its jobs). Each trainer start-up step's duration is
read from the trainer's log (``start-up: ...`` lines, one per step), so the table says where the time
goes. ``--fresh-ops`` points ``TORCH_EXTENSIONS_DIR`` at an empty folder for each run: what a node
sees where ``install.sh`` did not build DeepSpeed's op (the state every new environment was in before
``hpcrl build-ops``).

Run::

    .venv/bin/python bench/bench_startup.py --repeats 3              # after install.sh: ops built
    .venv/bin/python bench/bench_startup.py --repeats 3 --fresh-ops  # an environment without them
"""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^(\S+ \S+) trainer INFO hpcrl.control.startup: start-up: (.*) \(at most")


def steps(log: Path, first_update_s: float) -> dict[str, float]:
    """Seconds of each trainer start-up step, from its log (a step lasts until the next one begins; the last
    until the first update)."""
    marks = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = STEP.match(line)
        if m:
            marks.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(2)))
    ends = [t for t, _ in marks[1:]] + [first_update_s]
    return {re.sub(r" \(.*\)|\d+| builtin:\S+", "", name).strip(): end - t for (t, name), end in zip(marks, ends)}


def one_run(parent: Path, fresh_ops: bool, timeout_s: float, repo: Path) -> tuple[float, dict[str, float]]:
    run = Path(tempfile.mkdtemp(prefix="startup-", dir=parent)) / "run"
    env = dict(os.environ, PYTHONPATH=str(repo))
    if fresh_ops:
        env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="ext-", dir=parent)
    t0 = time.time()
    launcher = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(repo / "configs" / "tiny.yaml"),
                                 "--run-dir", str(run), "--executor", "local"], cwd=repo, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "logs" / "metrics.jsonl"
    try:
        while not (metrics.exists() and metrics.stat().st_size > 0):
            if launcher.poll() is not None or time.time() - t0 > timeout_s:
                raise RuntimeError(f"no update within {timeout_s:.0f}s (launcher rc {launcher.poll()}); see {run}")
            time.sleep(0.1)
        first = time.time()
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)
    return first - t0, steps(run / "logs" / "jobs" / "trainer.log", first)


def main(argv=None) -> int:
    p = bench_parser(__doc__, "one run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fresh-ops", action="store_true", help="an empty TORCH_EXTENSIONS_DIR for each run")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--repo", default=str(REPO), help="the checkout to launch (another commit, to compare)")
    a = p.parse_args(argv)
    parent = Path(tempfile.mkdtemp(prefix="bench_startup_", dir=a.dir))
    runs = [one_run(parent, a.fresh_ops, a.timeout_s, Path(a.repo)) for _ in range(1 if a.quick else a.repeats)]
    names = list(dict.fromkeys(n for _, s in runs for n in s))
    rows = [[f"run {i + 1}", f"{t:.1f}", *(f"{s.get(n, 0):.1f}" for n in names)] for i, (t, s) in enumerate(runs)]
    rows.append(["median", f"{statistics.median(t for t, _ in runs):.1f}",
                 *(f"{statistics.median(s.get(n, 0) for _, s in runs):.1f}" for n in names)])
    print(f"launch to first update, configs/tiny.yaml --executor local ({'fresh' if a.fresh_ops else 'built'} "
          "DeepSpeed ops); seconds; the trainer's start-up steps from its log")
    print(table(["", "first update", *names], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
