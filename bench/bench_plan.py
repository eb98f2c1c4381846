"""``hpcrl plan`` against simulated runs at cluster proportions: how far off is the prediction, and why?

Each case is a real simulated run (``configs/simulated-28k.yaml``: the real control plane on CPU, the GPU time
of a 7B model slept, long-tailed responses up to 28,672 tokens, ``hpcrl run --executor local``) and the
planner's fast event simulation of the same knobs (same phase model, same prompts from the data, so the same
response lengths; :mod:`hpcrl.plan.events`). Compared: steady throughput, trained tokens per modelled second
over updates 2..N (the run's wall seconds times ``simulated.time_scale``), and the step per update.

The grid: three trainer:engine splits (``simulated.trainer_gpus`` : ``resources.rollout_jobs``) x staleness
0.25, 0.5, 1 x partial rollout off/on, and cases with 8 rollout jobs.

What the planner leaves out is the control plane's own time (file polls, the shard commits, the tiny model's
real publish and load, the abort-and-save of partial rollout, the trainer's reading of its batch), which a
simulated run pays in wall seconds and so in ``time_scale`` times as many modelled seconds: at time_scale 20 a
50 ms poll is a modelled second. Each row therefore also gives that latency as measured from the run's logs
(modelled seconds per update; of it, "pause s" the abort-and-save per version and job) and the prediction with
it added to the phase model ("plan + cp"): the update, the publish and the weight switch as the run measured
them, and a version seen half a poll late. Not added: "commit s", a group's finish to its shard's commit (the
planner commits at the finish; the median, as a drain holds some on purpose, which the planner models), and the
rollout loop's turn from a commit to the next admission.

Run (each run is ~3-5 minutes on 2 shared cores, mostly start-up and sleep)::

    nice -n 10 .venv/bin/python bench/bench_plan.py --dir /tmp/grid --keep     # the grid: 21 runs
    nice -n 10 .venv/bin/python bench/bench_plan.py --dir /tmp/grid --keep --only 1,2 --time-scale 10
    .venv/bin/python bench/bench_plan.py --dir /tmp/grid --keep --analyse      # the table from kept runs
"""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402
from bench_async import REPO, logs, run  # noqa: E402

from hpcrl.logs import metric_names as M  # noqa: E402
from hpcrl.analysis.ceiling import ceiling  # noqa: E402
from hpcrl.config import load_config  # noqa: E402
from hpcrl.plan.events import Pipeline, predict  # noqa: E402
from hpcrl.plan.model import Draws  # noqa: E402
from hpcrl.plan.prompts import prompt_lengths  # noqa: E402
from hpcrl.plan.sweep import knobs_of  # noqa: E402
from hpcrl.rundir.fsio import read_jsonl  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

CONFIG = REPO / "configs" / "simulated-28k.yaml"
SPLITS = [(1, 3), (2, 2), (3, 1)]  # (trainer GPUs, rollout jobs)
CASES = [(tg, jobs, s, p) for tg, jobs in SPLITS for s in (0.25, 0.5, 1.0) for p in (False, True)] + [
    (2, 8, 0.5, True), (4, 8, 1.0, False), (4, 8, 0.25, True)]


def overrides(case: tuple, updates: int, time_scale: float) -> list[str]:
    tg, jobs, s, partial = case
    return [f"rollout.total_rollout_steps={8 * updates}", f"resources.rollout_jobs={jobs}",
            f"simulated.trainer_gpus={tg}", f"async_training.staleness_threshold={s}",
            f"async_training.partial_rollout={str(partial).lower()}", f"simulated.time_scale={time_scale:g}"]


def finished(rd: Path, updates: int) -> bool:
    m = rd / "logs" / "metrics.jsonl"
    done = rd / "control" / "trainer_done.json"
    return m.is_file() and len(m.read_text().splitlines()) >= updates and done.exists()


def control_plane(rd: Path, cfg) -> dict:
    """The control plane's own time in the run, modelled seconds (wall x time_scale) beyond the phase model: per
    update (the trainer's update and publish), per version and job (the load and the abort for partial rollout)."""
    ts, sim = cfg.simulated.time_scale, cfg.simulated
    rows = [json.loads(x) for x in (rd / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    upd = np.mean([r[M.UPDATE_S] * ts - r[M.SIMULATED_UPDATE_MODEL_S] for r in rows])
    pubs = [r[M.PARAM_SYNC_S] * ts - sim.publish_s for r in rows if r[M.PARAM_SYNC_S] > 0]
    ro = [json.loads(x) for p in sorted((rd / "logs").glob("rollout-*.jsonl")) for x in p.read_text().splitlines()]
    load = np.mean([r[M.LOAD_WEIGHTS_S] * ts - sim.weight_load_s for r in ro])
    pause = np.mean([r.get("timing_s/pause", 0.0) * ts for r in ro])
    st = list(read_jsonl(RunDir(rd).staleness))
    last: dict = {}  # a group finishes with its last response
    for r in st:
        last[r["group_id"]] = max(last.get(r["group_id"], (0.0, 0.0)), (r["finished_s"], r["committed_s"]))
    commit = np.median([(c - f) * ts for f, c in last.values()])  # the median: a drain holds some (modelled)
    return {"update": float(upd), "publish": float(np.mean(pubs)) if pubs else 0.0, "load": float(load),
            "pause": float(pause), "poll": cfg.timeouts.poll_interval_s * ts, "commit": float(commit)}


def with_control_plane(sim, cp: dict):
    """The phase model with the run's measured control-plane time added (module docstring)."""
    return dataclasses.replace(sim, update_base_s=sim.update_base_s + max(0.0, cp["update"]),
                               publish_s=sim.publish_s + max(0.0, cp["publish"]),
                               weight_load_s=sim.weight_load_s + max(0.0, cp["load"]) + cp["pause"])


def engines_per_version(rd: Path, groups: int) -> float:
    """How many rollout jobs started groups under each weight version, mean over versions (the first ``groups``
    prompts: those the window trains on): how the jobs spread a version's budget."""
    used: dict[int, set] = {}
    for r in read_jsonl(RunDir(rd).staleness):
        writer, index = r["group_id"].split("/")
        if int(index) < groups:
            used.setdefault(r["version_start"], set()).add(writer)
    return float(np.mean([len(w) for w in used.values()]))


def engines_per_version_plan(starts: list, groups: int) -> float:
    """:func:`engines_per_version` of the planner's starts ((version, job) in prompt order)."""
    used: dict[int, set] = {}
    for version, rank in starts[:groups]:
        used.setdefault(version, set()).add(rank)
    return float(np.mean([len(w) for w in used.values()]))


def analyse(rd: Path, case: tuple) -> list[str]:
    cfg = load_config(rd / "config.yaml")
    m, ro, _ = logs(rd)
    c = ceiling(m, ro)
    ts = cfg.simulated.time_scale
    tg, jobs, s, partial = case
    prompts, _ = prompt_lengths(cfg, None)
    k = knobs_of(cfg, jobs, tg, s, partial)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, prompts)
    pipe = Pipeline(cfg.simulated, k, draws, cfg.data.seed)
    plan = pipe.run(cfg.total_updates)
    cp = control_plane(rd, cfg)
    # a version switch is seen one poll late on average (half the interval), by the trainer's commits as well
    plan_cp = predict(with_control_plane(cfg.simulated, cp), k, cfg.total_updates, cfg.data.seed,
                      overhead_s=cp["poll"], draws=draws)
    measured = c.tokens / (c.measured_s * ts)
    groups = cfg.total_updates * k.groups_per_update
    spread_run, spread_plan = engines_per_version(rd, groups), engines_per_version_plan(pipe.starts, groups)
    err, err_cp = plan.tokens_per_s / measured - 1, plan_cp.tokens_per_s / measured - 1
    per_version = cp["publish"] + cp["load"] + cp["pause"] + cp["poll"]
    cp_per_update = cp["update"] + per_version / k.trigger_parameter_sync_step
    return [f"{tg}:{jobs}", f"{s:g}", "yes" if partial else "no", f"{ts:g}", f"{c.measured_s * ts / c.updates:.1f}",
            f"{plan.step_s:.1f}", f"{measured:.0f}", f"{plan.tokens_per_s:.0f}", f"{err:+.1%}",
            f"{cp_per_update:.1f}", f"{cp['pause']:.1f}", f"{cp['commit']:.1f}", f"{err_cp:+.1%}",
            f"{m[M.UPDATE_S].iloc[1:].sum() / c.measured_s:.2f}", f"{plan.trainer_busy:.2f}",
            "same" if plan.tokens == c.tokens else f"{plan.tokens / c.tokens - 1:+.1%}",
            f"{spread_run:.1f} / {spread_plan:.1f}"]


HEADER = ["trainer:engines", "s", "partial", "time_scale", "step s run", "step s plan", "tokens/s run", "tokens/s plan",
          "plan error", "cp s/update", "pause s", "commit s", "plan+cp error", "trainer busy run", "trainer busy plan",
          "tokens plan vs run", "engines/version run / plan"]


def main(argv=None) -> int:
    p = bench_parser(__doc__, "8 updates per run")
    p.add_argument("--updates", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--only", default="", help="comma-separated case numbers (1-based)")
    p.add_argument("--keep", action="store_true", help="keep the run directories; a finished one is not run again")
    p.add_argument("--analyse", action="store_true", help="only the table, from the kept runs that finished")
    a = p.parse_args(argv)
    if a.quick:
        a.updates = 8
    tmp_ctx = tempfile.TemporaryDirectory(dir=a.dir) if not a.keep else None
    root = Path(tmp_ctx.name if tmp_ctx else (a.dir or tempfile.mkdtemp()))
    rows = []
    for i, case in enumerate(CASES, 1):
        if a.only and str(i) not in a.only.split(","):
            continue
        rd = root / f"case{i}-ts{a.time_scale:g}-u{a.updates}"
        if not finished(rd, a.updates):
            if a.analyse:
                continue
            run(CONFIG, rd, overrides(case, a.updates, a.time_scale))
        rows.append([str(i)] + analyse(rd, case))
        print(" ".join(rows[-1]), flush=True)
    print(f"\n{a.updates} updates per run, {CONFIG.name} (R=8 groups x 8, K=2; modelled seconds = wall x time_scale); "
          f"trainer:engines = simulated.trainer_gpus : resources.rollout_jobs; runs in {root}")
    print(table(["case"] + HEADER, rows))
    errs = [abs(float(r[9].rstrip("%"))) for r in rows]
    errs_cp = [abs(float(r[13].rstrip("%"))) for r in rows]
    print(f"within 10 %: plan {sum(e <= 10 for e in errs)} of {len(rows)}, plan + control plane "
          f"{sum(e <= 10 for e in errs_cp)} of {len(rows)}; mean |error| plan {np.mean(errs):.1f} %, plan + control "
          f"plane {np.mean(errs_cp):.1f} %")
    if tmp_ctx:
        tmp_ctx.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
