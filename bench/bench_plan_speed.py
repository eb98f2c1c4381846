"""How long ``hpcrl plan`` takes at 32, 128 and 1,024 GPUs, before and after the fast simulation, and whether the
fast simulation agrees with the reference one.

The setting (``configs/plan-7b-math-28k.yaml``): a 7B math-RL run, n=16, R=128 groups per update, K=4,
responses up to 28,672 tokens (lognormal, mean 3,000), one GPU per engine, prompts of 256 tokens.

- **after**: ``python -m hpcrl plan CONFIG --gpus G --prompt-tokens 256`` of this checkout, wall and CPU seconds
  (one process, one core), and the same with the old sweep's candidates each simulated (``--splits 1:G-1 --all``:
  what the fast simulation alone buys, without the search);
- **before**: the planner of ``--before DIR`` (a checkout of the old code, e.g. ``git archive 808f781 hpcrl |
  tar -x -C DIR``) simulated every split x {0, 0.5, 1} x partial (``(G - 1) * 5`` candidates at 32 updates).
  A whole old sweep takes minutes at 32 GPUs and hours at 128, so it is **extrapolated**: the old ``predict`` is
  timed on ``--samples`` candidates spread over the splits, and the mean CPU seconds times the number of
  candidates is printed (labelled so). ``--before-full G`` runs the whole old sweep at G GPUs instead (e.g. 8).
- **agreement**: the fast and the reference simulation of this checkout on candidates of the 32-GPU sweep
  (``hpcrl/plan/events.py`` vs ``tests/plan_reference.py``).

Run::

    .venv/bin/python bench/bench_plan_speed.py --before /tmp/plan-before
    .venv/bin/python bench/bench_plan_speed.py --quick          # after only, 32 and 128 GPUs
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "plan-7b-math-28k.yaml"
PROMPT = 256

OLD_PREDICT = """
import json, sys, time
from hpcrl.config import load_config
from hpcrl.plan.pipeline import predict
from hpcrl.plan.sweep import knobs_of
cfg = load_config(sys.argv[1])
out = []
for jobs, tg, s, p in json.loads(sys.argv[2]):
    t = time.process_time()
    pred = predict(cfg.simulated, knobs_of(cfg, jobs, tg, s, p, int(sys.argv[3])), 32, cfg.data.seed)
    out.append([time.process_time() - t, pred.step_s])
print(json.dumps(out))
"""


def timed(cmd: list, cwd: Path, env=None) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=7200)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{out.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def old_candidates(gpus: int) -> list[tuple]:
    """The old sweep's candidates: every split x s in {0, 0.5, 1} x partial, partial dropped at s=0."""
    out = []
    for tg in range(1, gpus):
        for s in (0.0, 0.5, 1.0):
            for p in ((False,) if s == 0 else (False, True)):
                out.append((gpus - tg, tg, s, p))
    return out


def before(old: Path, gpus: int, samples: int) -> tuple[float, int]:
    """Extrapolated CPU seconds of the old sweep at ``gpus``: mean over ``samples`` spread candidates x count."""
    cands = old_candidates(gpus)
    step = max(1, len(cands) // samples)
    picked = cands[step // 2::step][:samples]
    env = dict(os.environ, PYTHONPATH=str(old), PYTHONDONTWRITEBYTECODE="1")
    _, _, out = timed([sys.executable, "-c", OLD_PREDICT, str(CONFIG), json.dumps(picked), str(PROMPT)], old, env)
    secs = [x[0] for x in json.loads(out)]
    return sum(secs) / len(secs) * len(cands), len(picked)


def agreement(n: int) -> list[list[str]]:
    """Fast vs reference on ``n`` candidates of the 32-GPU sweep (this checkout)."""
    from hpcrl.config import load_config
    sys.path.insert(0, str(REPO / "tests"))  # the reference simulation is the tests' oracle
    import plan_reference as reference
    from hpcrl.plan import events
    from hpcrl.plan.model import Draws
    from hpcrl.plan.sweep import knobs_of

    cfg = load_config(CONFIG)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, PROMPT)
    rows = []
    for tg, s, p in [(8, 0.0, False), (12, 0.5, False), (15, 1.0, True), (20, 0.5, True)][:n]:
        k = knobs_of(cfg, 32 - tg, tg, s, p)
        t = time.process_time()
        fast = events.predict(cfg.simulated, k, 32, cfg.data.seed, draws=draws)
        tf, t = time.process_time() - t, time.process_time()
        ref = reference.predict(cfg.simulated, k, 32, cfg.data.seed, draws=draws)
        tr = time.process_time() - t
        rows.append([f"{tg}:{32 - tg}", f"{s:g}", "yes" if k.partial_rollout else "no", f"{ref.step_s:.2f}",
                     f"{fast.step_s:.2f}", f"{fast.tokens_per_s / ref.tokens_per_s - 1:+.3%}",
                     f"{fast.lag_mean - ref.lag_mean:+.3f}", f"{tr:.1f}", f"{tf:.2f}"])
        print(" ".join(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = bench_parser(__doc__, "after only, at 32 and 128 GPUs; no agreement rows")
    p.add_argument("--before", default=None, metavar="DIR", help="a checkout of the old planner (its hpcrl/)")
    p.add_argument("--samples", type=int, default=3, help="old candidates timed per GPU count (default 3)")
    p.add_argument("--before-full", type=int, default=None, metavar="G", help="run the whole old sweep at G GPUs")
    p.add_argument("--gpus", default="32,128,1024")
    p.add_argument("--agreement", type=int, default=4, help="candidates compared fast vs reference (default 4)")
    p.add_argument("--every-up-to", type=int, default=128, metavar="G",
                   help="also time `--splits 1:G-1 --all` (the old sweep's candidates, each simulated) up to G GPUs")
    a = p.parse_args(argv)
    sizes = [32, 128] if a.quick else [int(x) for x in a.gpus.split(",")]
    rows = []
    for g in sizes:
        wall, cpu, out = timed([sys.executable, "-m", "hpcrl", "plan", str(CONFIG), "--gpus", str(g),
                                "--prompt-tokens", str(PROMPT)], REPO)
        searched = next(x for x in out.splitlines() if x.startswith("searched"))
        best = out.split("best (highest throughput first):")[1].strip().splitlines()[0].split(":")[0]
        counts = [part.split()[1] for part in searched.split(",")[:2]]
        row = [str(g), f"{wall:.1f}", f"{cpu:.1f}", *counts,
               best.strip()]
        if g <= a.every_up_to:  # the old sweep's candidates, every one simulated: the simulation's own speed-up
            _, cpu_all, out = timed([sys.executable, "-m", "hpcrl", "plan", str(CONFIG), "--gpus", str(g),
                                     "--prompt-tokens", str(PROMPT), "--splits", f"1:{g - 1}", "--all"], REPO)
            row.append(f"{cpu_all:.1f} ({len(old_candidates(g))})")
        else:
            row.append("-")
        if a.before and not a.quick:
            old_s, n = before(Path(a.before), g, a.samples)
            row += [f"{old_s:.0f} (extrapolated from {n})", f"{old_s / cpu:.0f}x"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    if a.before and a.before_full:
        env = dict(os.environ, PYTHONPATH=a.before, PYTHONDONTWRITEBYTECODE="1")
        wall, cpu, _ = timed([sys.executable, "-m", "hpcrl", "plan", str(CONFIG), "--gpus", str(a.before_full)],
                             Path(a.before), env)
        print(f"before, whole sweep at {a.before_full} GPUs: {wall:.1f}s wall, {cpu:.1f}s CPU "
              f"({len(old_candidates(a.before_full))} candidates)")
    header = ["GPUs", "after wall s", "after CPU s", "candidates", "simulated", "best",
              "after CPU s, every split, --all (candidates)"]
    if a.before and not a.quick:
        header += ["before CPU s", "after vs before"]
    print(f"\n{CONFIG.name}, prompts {PROMPT} tokens, 32 updates per candidate; CPU seconds of one process")
    print(table(header, rows))
    if not a.quick and a.agreement:
        print("\nfast vs reference simulation, 32-GPU candidates (32 updates; CPU seconds each):")
        agr = agreement(a.agreement)
        print(table(["trainer:engines", "s", "partial", "step s reference", "step s fast", "tokens/s fast vs ref",
                     "lag mean diff", "reference s", "fast s"], agr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
