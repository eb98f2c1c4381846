"""How a version's admission budget is shared over the fleet, as ``hpcrl plan`` predicts it: by load
(``rollout.budget_share=load``, ``rollout.max_concurrent_groups=auto``, the default) against first come with a
fixed per-job cap (``budget_share=first_come``, the rule before), on the 7B math phase model of
``configs/plan-7b-math-28k.yaml`` (n=16, R=128 groups per update, K=4, lognormal responses of mean 3,000 tokens
cut at 28,672, prompts of 256 tokens, one GPU per engine, partial rollout on where s > 0).

Each row is one split (half trainer, half engines) and one staleness threshold: the predicted seconds per
parameter-sync period (K updates) with each fixed cap and with ``auto``; "auto vs best" is auto's period over the
best fixed cap's, "auto vs 16" over the cap of 16's (verl's per-server number). Every row is the fast simulation
(``hpcrl/plan/events.py``) of the same draws, 32 updates, the steady window over updates 2..32.

Run::

    .venv/bin/python bench/bench_share.py                      # 32, 128 and 1,024 GPUs at s = 0, 0.5, 1
    .venv/bin/python bench/bench_share.py --quick              # 128 GPUs, s = 0.5
    .venv/bin/python bench/bench_share.py --gpus 128 --staleness 0.5 --caps 2,4,6,8,12,16
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "plan-7b-math-28k.yaml"
PROMPT = 256
CAPS = (4, 6, 8, 12, 16)


def periods(gpus: int, staleness: float, caps: tuple, updates: int) -> tuple[dict, float, int, int]:
    """(cap -> s/sync first come, s/sync auto by load, engines, B) of the half-and-half split at ``gpus``."""
    from hpcrl.config import load_config
    from hpcrl.config.names import FIRST_COME, SHARE_BY_LOAD
    from hpcrl.plan.events import predict
    from hpcrl.plan.model import Draws
    from hpcrl.plan.sweep import knobs_of

    cfg = load_config(CONFIG)
    engines = gpus // 2
    base = knobs_of(cfg, engines, gpus - engines, staleness, staleness > 0, PROMPT)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, PROMPT)

    def period(**change) -> float:
        return predict(cfg.simulated, dataclasses.replace(base, **change), updates, cfg.data.seed,
                       draws=draws).sync_period_s

    fixed = {c: period(max_concurrent_groups=c, budget_share=FIRST_COME) for c in caps}
    return fixed, period(max_concurrent_groups="auto", budget_share=SHARE_BY_LOAD), engines, base.budget


def main(argv=None) -> None:
    p = bench_parser(__doc__, "128 GPUs at s = 0.5 only")
    p.add_argument("--gpus", default="32,128,1024", help="GPU budgets (comma-separated)")
    p.add_argument("--staleness", default="0,0.5,1", help="staleness thresholds (comma-separated)")
    p.add_argument("--caps", default=",".join(map(str, CAPS)), help="fixed caps of first come (comma-separated)")
    p.add_argument("--updates", type=int, default=32)
    a = p.parse_args(argv)
    gpus = [128] if a.quick else [int(x) for x in a.gpus.split(",")]
    stal = [0.5] if a.quick else [float(x) for x in a.staleness.split(",")]
    caps = tuple(int(x) for x in a.caps.split(","))
    rows = []
    for g in gpus:
        for s in stal:
            t0 = time.process_time()
            fixed, auto, engines, budget = periods(g, s, caps, a.updates)
            best = min(fixed, key=fixed.get)
            rows.append([f"{g - engines}:{engines}", f"{s:g}", str(budget), *(f"{fixed[c]:.1f}" for c in caps),
                         f"{auto:.1f}", f"{auto / fixed[best]:.3f} (cap {best})",
                         f"{auto / fixed[16]:.3f}" if 16 in fixed else "-", f"{time.process_time() - t0:.0f}"])
            print(table(["trainer:engines", "s", "B", *(f"cap {c}" for c in caps), "auto", "auto vs best",
                         "auto vs 16", "CPU s"], rows[-1:]), flush=True)
    print()
    print(table(["trainer:engines", "s", "B", *(f"cap {c}" for c in caps), "auto", "auto vs best", "auto vs 16",
                 "CPU s"], rows))


if __name__ == "__main__":
    main()
