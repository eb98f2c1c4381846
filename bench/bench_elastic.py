"""Throughput against the number of rollout jobs, on the simulated engine: where the trainer becomes the bottleneck.

One run of ``configs/simulated.yaml`` per fleet size (``resources.rollout_jobs`` = 1, 2, 4, 8), launched as a user
would (``hpcrl run --executor local``), in a rollout-bound setting: each rollout job runs at most
``rollout.max_concurrent_groups=2`` groups (a small engine: one group of 8 lognormal responses, mean 512 tokens, cut
at 1536, takes ~30 modelled seconds of decoding), the trainer takes R=4 groups per update (2 s + 1 ms per token:
~18 modelled seconds), s=1 with partial rollout, time_scale 10. The prompt claims (``control/claims.py``) split
the one prompt stream between however many jobs run. The admission budget ``B = (1 + s) * K * R`` (8 groups at
s=1) caps the groups the whole fleet may have started and not yet had trained, so the fleet may wait on the budget
(its idle ratio rises) before the trainer is saturated; ``--staleness 3`` (B=16) moves that cap.

Measured on 2 CPU cores (``--quick``): at s=1, 0.85 / 1.53 / 1.69 / 1.72 groups/s with 1 / 2 / 4 / 8 jobs,
trainer idle 0.66 / 0.39 / 0.37 / 0.35 and rollout idle 0.00 / 0.03 / 0.36 / 0.61 (the budget binds from 4 jobs);
at s=3, 0.83 / 2.52 / 2.48 groups/s with 1 / 4 / 8 jobs, trainer idle 0.66 / 0.04 / 0.00: the trainer is the
bottleneck from 4 jobs on.

Measured over the steady window (from the moment every rollout job has committed a group to the end of the last
update, so that start-up, which is slow for 8 jobs on 2 cores, is left out): groups trained per second (wall,
on this machine; x time_scale for modelled GPU seconds), the speed-up over one job, the trainer's mean idle ratio
(wait / (wait + update + sync)) and the rollout jobs' mean idle ratio over the updates of that window, the largest
lag of a group's newest token (bounded by ``max_lag_bound``, 1 here) and of its oldest (partial rollout adds the
span), and the exactly-once audit (hpcrl/analysis/exactly_once.py). The trainer is the bottleneck once its idle
ratio is near 0 and groups/s stops rising.

Run::

    .venv/bin/python bench/bench_elastic.py --quick    # 20 updates per run (~8 minutes on 2 cores)
    .venv/bin/python bench/bench_elastic.py            # 40 updates per run
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.config.knobs import admission_budget  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

SETTING = ["rollout.max_concurrent_groups=2", "actor.ppo_mini_batch_size=4", "async_training.partial_rollout=true",
           "trainer.checkpoint_every_updates=1000000"]


def run(run_dir: Path, jobs: int, updates: int, staleness: float) -> float:
    """Launch one run to its end; its wall seconds."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "simulated.yaml"), *SETTING,
                          f"async_training.staleness_threshold={staleness}",
                          f"resources.rollout_jobs={jobs}", f"rollout.total_rollout_steps={4 * updates}",
                          "--run-dir", str(run_dir), "--executor", "local", "--timeout-min", "30"],
                         capture_output=True, text=True, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"run {run_dir.name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0


def steady(run_dir: Path) -> dict:
    """Groups/s and idle ratios over the window in which every rollout job was producing."""
    rd = RunDir(run_dir)
    st = pd.read_json(rd.staleness, lines=True).drop_duplicates("group_id")
    m = pd.read_json(rd.metrics, lines=True)
    ro = pd.concat([pd.read_json(p, lines=True) for p in rd.rollout_metrics_logs().values()])
    start = st.groupby("writer").committed_s.min().max()  # the last writer's first commit
    end = st.consumed_s.max()
    window = st[st.consumed_s > start]
    steps = set(window.trainer_step)
    idle_t = m[m.step.isin(steps)]["trainer/idle_ratio"].mean()
    idle_r = ro[ro.param_version >= m[m.step.isin(steps)].param_version.min()]["rollouter/idle_ratio"].mean()
    a = audit(rd, 2)
    full = pd.read_json(rd.staleness, lines=True)
    lag_end = full.trainer_version - full.groupby("group_id").version_end.transform("max")  # the newest token
    return {"groups_s": len(window) / (end - start), "window_s": end - start, "updates": len(steps),
            "idle_trainer": idle_t, "idle_rollout": idle_r, "lag_max": f"{int(lag_end.max())}/{int(st.lag.max())}",
            "problems": sum(len(v) for v in a.problems().values())}


def main(argv=None) -> int:
    p = bench_parser(__doc__, "20 updates per run")
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--jobs", default="1,2,4,8", help="comma-separated fleet sizes")
    p.add_argument("--staleness", type=float, default=1.0, help="async_training.staleness_threshold s: the budget "
                   "B = (1 + s) * 4 groups caps the groups in flight of the whole fleet")
    p.add_argument("--keep", action="store_true", help="keep the run directories (their path is printed)")
    a = p.parse_args(argv)
    if a.quick:
        a.updates = 20
    rows, base = [], None
    folder = contextlib.nullcontext(tempfile.mkdtemp(dir=a.dir)) if a.keep else tempfile.TemporaryDirectory(dir=a.dir)
    with folder as tmp:
        if a.keep:
            print(f"run directories under {tmp}", flush=True)
        for jobs in map(int, a.jobs.split(",")):
            rd = Path(tmp) / f"jobs{jobs}"
            wall = run(rd, jobs, a.updates, a.staleness)
            s = steady(rd)
            base = base or s["groups_s"]
            rows.append([jobs, f"{wall:.0f}", f"{s['window_s']:.1f}", s["updates"], f"{s['groups_s']:.2f}",
                         f"{s['groups_s'] / base:.2f}", f"{s['idle_trainer']:.2f}", f"{s['idle_rollout']:.2f}",
                         s["lag_max"], s["problems"]])
            print(f"{jobs} rollout job(s): {s['groups_s']:.2f} groups/s, trainer idle {s['idle_trainer']:.2f}",
                  flush=True)
    budget = admission_budget(a.staleness, 1, 4)  # K=1, R=4 (configs/simulated.yaml)
    print(f"\n{a.updates} updates of 4 groups x 8 per run, simulated engine and trainer (configs/simulated.yaml, "
          f"time_scale 10), max_concurrent_groups=2 per job, s={a.staleness:g} + partial (budget B={budget} groups "
          "ahead of the trainer for the whole fleet); steady window: every job producing")
    print(table(["rollout jobs", "wall s", "window s", "updates", "groups/s", "speed-up", "trainer idle",
                 "rollout idle", "max lag new/old", "audit problems"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
