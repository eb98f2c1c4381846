"""``hpcrl plan`` against simulated runs of the same phase model: is the prediction within 10 %?

Each case is a real simulated run (``configs/simulated.yaml``: the real control plane, GPU time slept,
``hpcrl run --executor local``) and the planner's event simulation of the same knobs (same phase model,
same prompts, so the same response lengths). Compared: steady throughput (trained tokens per modelled
second over updates 2..N: the run's wall seconds times ``simulated.time_scale``) and step time. The cases
span trainer:rollout splits (``resources.rollout_jobs``, ``simulated.trainer_gpus``), staleness and
partial rollout.

Run::

    .venv/bin/python bench/bench_plan.py --quick     # 16 updates per run, ~10 minutes
    .venv/bin/python bench/bench_plan.py             # 32 updates per run
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402
from bench_async import REPO, logs, run  # noqa: E402

from hpcrl.analysis.ceiling import ceiling  # noqa: E402
from hpcrl.config import load_config  # noqa: E402
from hpcrl.plan.pipeline import predict  # noqa: E402
from hpcrl.plan.sweep import knobs_of  # noqa: E402

CASES = [  # (rollout jobs, trainer GPUs, staleness, partial)
    (1, 1, 0.0, False), (1, 1, 0.5, False), (1, 1, 0.5, True), (1, 2, 1.0, False),
    (2, 1, 0.5, False), (2, 2, 1.0, True), (3, 1, 1.0, True),
]


def main(argv=None) -> int:
    p = bench_parser(__doc__, "16 updates per run")
    p.add_argument("--updates", type=int, default=32)
    p.add_argument("--only", default="", help="comma-separated case numbers (1-based)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (their path is printed)")
    a = p.parse_args(argv)
    if a.quick:
        a.updates = 16
    config = REPO / "configs" / "simulated.yaml"
    rows, errors = [], []
    with (contextlib.nullcontext(tempfile.mkdtemp(dir=a.dir)) if a.keep else tempfile.TemporaryDirectory(dir=a.dir)) as tmp:
        for i, (jobs, tg, s, partial) in enumerate(CASES, 1):
            if a.only and str(i) not in a.only.split(","):
                continue
            overrides = [f"rollout.total_rollout_steps={4 * a.updates}", f"resources.rollout_jobs={jobs}",
                         f"simulated.trainer_gpus={tg}", f"async_training.staleness_threshold={s}",
                         f"async_training.partial_rollout={str(partial).lower()}"]
            cfg = load_config(config, overrides)
            pred = predict(cfg.simulated, knobs_of(cfg, jobs, tg, s, partial, prompt_tokens=2), a.updates, cfg.data.seed)
            if a.keep:
                print(f"run directory: {Path(tmp)}", flush=True)
            rd = Path(tmp) / f"case{i}"
            run(config, rd, overrides)
            m, ro, _ = logs(rd)
            c = ceiling(m, ro)
            scale = cfg.simulated.time_scale
            measured = c.tokens / (c.measured_s * scale)
            err = pred.tokens_per_s / measured - 1
            errors.append(abs(err))
            rows.append([str(i), f"{tg}:{jobs}", f"{s:g}", "yes" if partial else "no",
                         f"{c.measured_s * scale / c.updates:.1f}", f"{pred.step_s:.1f}", f"{measured:.0f}",
                         f"{pred.tokens_per_s:.0f}", f"{err:+.1%}", f"{m['trainer/idle_ratio'].iloc[1:].mean():.2f}",
                         f"{1 - pred.trainer_busy:.2f}"])
            print(" ".join(rows[-1]), flush=True)
    print(f"\n{a.updates} updates per run, configs/simulated.yaml (modelled seconds = wall x {scale:g}); "
          f"trainer:engines = simulated.trainer_gpus : resources.rollout_jobs")
    print(table(["case", "trainer:engines", "s", "partial", "step s run", "step s plan", "tokens/s run",
                 "tokens/s plan", "plan error", "trainer idle run", "trainer idle plan"], rows))
    print(f"within 10 %: {sum(e <= 0.10 for e in errors)} of {len(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
