"""What asynchrony and partial rollout buy when response lengths have a long tail, against the ceiling.

Four runs of the same task and the same number of trainer steps, launched as a user would
(``hpcrl run --executor local``):

- (a) on-policy: K=1, s=0 (the rollout waits for each new version; the trainer for each batch);
- (b) s=0.5 without partial rollout: generation overlaps training, but a version change waits
  for the slowest group in flight;
- (c) s=0.5 with partial rollout: a version change aborts generation and continues it under the new
  weights;
- (d) s=1 with partial rollout;
- (e) s=1 without partial rollout (what partial rollout buys where the budget leaves room).

**Default: the simulated engine and trainer** (``configs/simulated.yaml``): GPU-cluster proportions on
this CPU machine, the real control plane (shards, admission, weight files, checkpoints) with the GPU
work slept: vLLM-like continuous batching (decode step 0.02 s + 0.1 ms per running sequence, at most
256), lognormal response lengths (mean 512, sigma 1, cut at 1536), an update of 2 s + 1 ms per token on
one GPU, a 1 s weight switch; time_scale 10. On-policy, generation takes about twice the update.
``--engine transformers`` runs the old CPU task instead (the tiny model at lr 1e-9, geometric lengths):
there both jobs share two cores, so it measures contention more than the pipeline.

Reported per run: wall time (launch to end), steady time (end of the first update to end of the last:
start-up left out), the ideal-overlap bound of the run's own phase times over the same window
(hpcrl/analysis/ceiling.py: max(generation + weight switch, update + publish)) and bound / steady
(1.0 = as good as the phase times allow), the budget-aware bound (hpcrl/analysis/budget_bound.py: the
admission budget lets the rollout run only s batches ahead, which chains publish -> weight switch -> the
groups that need the new version -> update) and bound / steady for it, and the steady time against (a).

Run::

    .venv/bin/python bench/bench_async.py --quick     # 16 updates per run, ~8 minutes
    .venv/bin/python bench/bench_async.py             # 32 updates per run
"""
from __future__ import annotations

import subprocess
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hpcrl.analysis.ceiling import ceiling  # noqa: E402
from hpcrl.config import load_config  # noqa: E402
from hpcrl.logs.run_logs import read_staleness  # noqa: E402
from hpcrl.config.registries import ENGINES  # noqa: E402

MODES = {
    "(a) on-policy s=0": ["async_training.staleness_threshold=0"],
    "(b) s=0.5": ["async_training.staleness_threshold=0.5"],
    "(c) s=0.5 + partial": ["async_training.staleness_threshold=0.5", "async_training.partial_rollout=true"],
    "(d) s=1 + partial": ["async_training.staleness_threshold=1.0", "async_training.partial_rollout=true"],
    "(e) s=1, no partial": ["async_training.staleness_threshold=1.0"],
}


def run(config: Path, run_dir: Path, overrides: list[str]) -> float:
    """Launch one run to its end; its wall seconds."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(config), *overrides,
                          "--run-dir", str(run_dir), "--executor", "local", "--timeout-min", "30"],
                         capture_output=True, text=True, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"run {run_dir.name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0


def logs(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(metrics, rollout rows of every writer, staleness) of a finished run."""
    lg = run_dir / "logs"
    ro = pd.concat([pd.read_json(p, lines=True) for p in sorted(lg.glob("rollout-*.jsonl"))])
    return (pd.read_json(lg / "metrics.jsonl", lines=True), ro, read_staleness(run_dir))


def common_overrides(a) -> tuple[Path, list[str]]:
    """The config and the overrides every mode shares."""
    if a.engine == "simulated":
        return REPO / "configs" / "simulated.yaml", [f"rollout.total_rollout_steps={4 * a.updates}"]
    common = [f"rollout.total_rollout_steps={4 * a.updates}", f"rollout.response_length={a.tokens}",
              "actor.lr=1e-9", "rollout.max_concurrent_groups=4", "trainer.checkpoint_every_updates=1000000",
              "eval.every_versions=0"]
    if a.engine == "vllm":
        common += ["rollout.engine=vllm", "model.path=builtin:tiny-h64"]
    return REPO / "configs" / "tiny.yaml", common


def main(argv=None) -> int:
    p = bench_parser(__doc__, "16 updates per run")
    p.add_argument("--updates", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="transformers/vllm engines: response cap")
    p.add_argument("--engine", default="simulated", choices=list(ENGINES))
    p.add_argument("--only", default="", help="comma-separated mode letters to run, e.g. a,c")
    p.add_argument("--keep", action="store_true", help="keep the run directories (their path is printed)")
    a = p.parse_args(argv)
    if a.quick:
        a.updates = 16
    config, common = common_overrides(a)
    modes = {k: v for k, v in MODES.items() if not a.only or k[1] in a.only.split(",")}
    rows, first_steady = [], None
    with (contextlib.nullcontext(tempfile.mkdtemp(dir=a.dir)) if a.keep else tempfile.TemporaryDirectory(dir=a.dir)) as tmp:
        for i, (name, overrides) in enumerate(modes.items()):
            if a.keep:
                print(f"run directory: {Path(tmp)}", flush=True)
            rd = Path(tmp) / f"mode{i}"
            wall = run(config, rd, [*common, *overrides])
            m, ro, st = logs(rd)
            cfg = load_config(rd / "config.yaml")
            c = ceiling(m, ro, staleness=st, budget=(cfg.async_training.trigger_parameter_sync_step,
                                                     cfg.groups_per_update, cfg.admission_budget))
            first_steady = first_steady or c.measured_s
            rows.append([name, f"{wall:.1f}", f"{c.measured_s:.1f}", f"{c.bound_s:.1f}", f"{c.ratio:.2f}",
                         f"{c.budget_bound_s:.1f}", f"{c.budget_ratio:.2f}",
                         f"{c.measured_s / first_steady:.2f}", f"{c.generation_s:.1f}", f"{c.switch_s:.1f}",
                         f"{c.update_s + c.publish_s:.1f}", f"{m['trainer/idle_ratio'].iloc[1:].mean():.2f}",
                         f"{st.n_tokens.mean():.0f}", f"{st.lag.max()}", f"{(st.version_end > st.version_start).mean():.0%}"])
            print(f"{name}: steady {c.measured_s:.1f}s, bound {c.bound_s:.1f}s, ratio {c.ratio:.2f}; budget-aware bound "
                  f"{c.budget_bound_s:.1f}s, ratio {c.budget_ratio:.2f} ({c.budget.describe()})", flush=True)
    print(f"\n{a.updates} updates of 4 groups x 8 per run, {a.engine} engine ({config.name}); seconds are wall "
          f"seconds over updates 2..N")
    print(table(["mode", "wall s", "steady s", "bound s", "bound/steady", "budget bound s", "budget/steady", "vs (a)", "gen s", "switch s",
                 "train s", "trainer idle", "mean tokens", "max lag", "partial"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
