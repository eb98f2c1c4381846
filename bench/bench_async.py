"""What asynchrony and partial rollout buy when response lengths have a long tail.

Three runs of the same task, the same number of trainer steps, launched as a user would
(``hpcrl run --executor local``, the transformers engine on CPU unless ``--engine vllm``):

- (a) on-policy pipeline: K=1, s=0 (the rollout waits for each new version; the trainer
  waits for each batch);
- (b) s>0 without partial rollout: generation overlaps training, but a version change
  waits for the slowest group in flight;
- (c) s>0 with partial rollout: a version change aborts generation and continues it
  under the new weights.

The task: the tiny model at (almost) no learning rate (``actor.lr=1e-9``: lengths stay as
they are), so each response runs until its EOS, drawn at every step with the model's
probability (~1/64 at random init): lengths are geometric, mean ~64, cut at
``--tokens``; the slowest of a group's n responses (and of the groups in flight) sets the
pace, which is the straggler effect partial rollout removes.

Reported: wall time of each run (launcher start to ``run finished``) and its steady part
(first update to last: engine start-up, ~30 s for vLLM on CPU, left out), the steady time's
ratio to (a), and each against the **ideal overlap bound** computed from (a)'s measured phase times:
generation (rollout busy time, sum of ``wall_s * (1 - idle)`` over versions) and training
(``timing_s/update + timing_s/param_sync`` summed); fully overlapped, a run cannot take
less than max(generation, training), and (a) takes about their sum.

Run::

    .venv/bin/python bench/bench_async.py --quick      # ~2 minutes on 2 cores
    .venv/bin/python bench/bench_async.py              # 60 updates of 4 groups x 8, <= 256 tokens
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "(a) on-policy K=1 s=0": ["async_training.staleness_threshold=0"],
    "(b) s=1, no partial": ["async_training.staleness_threshold=1.0"],
    "(c) s=1, partial rollout": ["async_training.staleness_threshold=1.0", "async_training.partial_rollout=true"],
}


def run(run_dir: Path, overrides: list[str]) -> float:
    """Launch one run to its end; its wall seconds."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny.yaml"), *overrides,
                          "--run-dir", str(run_dir), "--executor", "local", "--timeout-min", "30"],
                         capture_output=True, text=True, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"run {run_dir.name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0


def steady_s(run_dir: Path) -> float:
    """Seconds from the first update's end to the last one's: the run without start-up (engine
    start, model build), per update count N - 1."""
    m = pd.read_json(run_dir / "logs" / "metrics.jsonl", lines=True)
    return float(m["time_s"].iloc[-1] - m["time_s"].iloc[0])


def phases(run_dir: Path) -> tuple[float, float]:
    """(generation busy s, training s) of a finished run, from its logs, scaled to N - 1 updates
    (the span :func:`steady_s` measures)."""
    ro = pd.concat([pd.read_json(p, lines=True) for p in sorted((run_dir / "logs").glob("rollout-*.jsonl"))])
    m = pd.read_json(run_dir / "logs" / "metrics.jsonl", lines=True)
    scale = (len(m) - 1) / len(m)
    generation = float((ro["wall_s"] * (1 - ro["rollouter/idle_ratio"])).sum()) * scale
    training = float((m["timing_s/update"] + m["timing_s/param_sync"]).sum()) * scale
    return generation, training


def main(argv=None) -> int:
    p = bench_parser(__doc__, "20 updates, <= 128 tokens")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    a = p.parse_args(argv)
    if a.quick:
        a.updates, a.tokens = 20, 128
    common = [f"rollout.total_rollout_steps={4 * a.updates}", f"rollout.response_length={a.tokens}",
              "actor.lr=1e-9", "rollout.max_concurrent_groups=4", "trainer.checkpoint_every_updates=1000000"]
    if a.engine == "vllm":
        common += ["rollout.engine=vllm", "model.path=builtin:tiny-h64"]
    rows, walls, steady = [], {}, {}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for i, (name, overrides) in enumerate(MODES.items()):
            rd = Path(tmp) / f"mode{i}"
            walls[name] = run(rd, [*common, *overrides])
            steady[name] = steady_s(rd)
            if i == 0:
                generation, training = phases(rd)
                ideal = max(generation, training)
            st = pd.read_json(rd / "logs" / "staleness.jsonl", lines=True)
            first = next(iter(MODES))
            rows.append([name, f"{walls[name]:.1f}", f"{steady[name]:.1f}", f"{steady[name] / steady[first]:.2f}",
                         f"{ideal / steady[name]:.2f}", f"{st.n_tokens.mean():.0f}", f"{st.n_tokens.max()}",
                         f"{st.lag.max()}", f"{(st.version_end > st.version_start).mean():.0%}"])
    print(f"\n{a.updates} updates of 4 groups x 8, responses <= {a.tokens} tokens (geometric lengths), "
          f"{a.engine} engine; run (a): generation {generation:.1f}s, training {training:.1f}s, "
          f"ideal overlap max(...) = {ideal:.1f}s, over updates 2..N")
    print("wall: launch to end (start-up included); steady: first update to last (what the ratios use)")
    print(table(["mode", "wall s", "steady s", "vs (a)", "ideal / steady", "mean tokens", "max tokens", "max lag",
                 "partial"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
