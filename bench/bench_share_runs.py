"""The admission budget shared by load, on the real control plane: 32 simulated rollout jobs on one run directory,
first come with a cap of 16 against ``auto`` by load, the same seed, each against ``hpcrl plan``'s prediction.

Each run is ``configs/simulated.yaml`` (decode step 0.02 s + 0.1 ms per running sequence, lognormal responses of
mean 512 cut at 1536, n=8, an update of 2 s + 1 ms per token on ``simulated.trainer_gpus``=8, a 1 s weight switch)
with 32 rollout jobs, R = 32 groups per update (one version per update), s = 0.5 with partial rollout, so the
budget is B = 48 groups per version: first come with a cap of 16 lets the first three jobs to load a version
take all of it, by load every job takes one or two. Launched as a user would (``hpcrl run --executor local``),
``simulated.time_scale`` 5. Reported per run: the steady modelled seconds per update (updates 2..N: the run's wall
seconds x time_scale), the planner's prediction of the same knobs and prompts (:mod:`hpcrl.plan.events`), and the
same with the control plane's own time the run measured added (``bench/bench_plan.py``'s "plan + control
plane"), how many jobs started groups per version in the run and in the plan, and the exactly-once audit; then
the ratio cap 16 / auto, measured and predicted.

``--elastic``: one run by load that starts with half the jobs, is grown to all of them (``hpcrl scale``) after a
third of its updates and shrunk to three quarters after two thirds (the newest drain): per version, how many jobs
started groups and how evenly (groups per job: least and most), the first version under which the new jobs started
groups against the version at their join, and the groups per job before and after the drain.

Run (each run is ~5-10 minutes on 2 shared cores)::

    nice -n 10 .venv/bin/python bench/bench_share_runs.py --dir /tmp/share --keep
    nice -n 10 .venv/bin/python bench/bench_share_runs.py --dir /tmp/share --keep --elastic
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402
from bench_async import REPO, logs, run  # noqa: E402
from bench_plan import control_plane, engines_per_version, engines_per_version_plan, with_control_plane  # noqa: E402

from hpcrl.analysis.ceiling import ceiling  # noqa: E402
from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.config import load_config  # noqa: E402
from hpcrl.control.fleet_log import read_fleet_events  # noqa: E402
from hpcrl.rundir.fsio import read_jsonl  # noqa: E402
from hpcrl.logs.run_logs import read_staleness  # noqa: E402
from hpcrl.plan.events import Pipeline, predict  # noqa: E402
from hpcrl.plan.model import Draws  # noqa: E402
from hpcrl.plan.prompts import prompt_lengths  # noqa: E402
from hpcrl.plan.sweep import knobs_of  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

CONFIG = REPO / "configs" / "simulated.yaml"
RULES = {"cap 16, first come": ["rollout.max_concurrent_groups=16", "rollout.budget_share=first_come"],
         "auto, by load": ["rollout.max_concurrent_groups=auto", "rollout.budget_share=load"]}


def setting(jobs: int, groups: int, updates: int, time_scale: float) -> list[str]:
    return [f"resources.rollout_jobs={jobs}", f"actor.ppo_mini_batch_size={groups}",
            f"actor.ppo_micro_batch_size={groups}", f"rollout.total_rollout_steps={groups * updates}",
            "simulated.trainer_gpus=8", "async_training.staleness_threshold=0.5", "async_training.partial_rollout=true",
            f"simulated.time_scale={time_scale:g}", "trainer.checkpoint_every_updates=1000", "rollout.seal_groups=1",
            "timeouts.wait_samples_s=1200", "timeouts.job_start_s=1500", "resources.rollout.mem_gb=1"]


def analyse(rd: Path, jobs: int) -> dict:
    """The run's steady step against the planner's, as ``bench_plan.analyse`` measures them."""
    cfg = load_config(rd / "config.yaml")
    m, ro, _ = logs(rd)
    c = ceiling(m, ro)
    ts = cfg.simulated.time_scale
    prompts, _ = prompt_lengths(cfg, None)
    k = knobs_of(cfg, jobs, cfg.simulated.trainer_gpus, cfg.async_training.staleness_threshold,
                 cfg.async_training.partial_rollout)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, prompts)
    pipe = Pipeline(cfg.simulated, k, draws, cfg.data.seed)
    plan = pipe.run(cfg.total_updates)
    cp = control_plane(rd, cfg)
    plan_cp = predict(with_control_plane(cfg.simulated, cp), k, cfg.total_updates, cfg.data.seed,
                      overhead_s=cp["poll"], draws=draws)
    groups = cfg.total_updates * k.groups_per_update
    problems = audit(RunDir(rd), k.group_bound).problems()
    return {"step": c.measured_s * ts / c.updates, "plan": plan.step_s, "plan_cp": plan_cp.step_s,
            "spread": engines_per_version(rd, groups), "spread_plan": engines_per_version_plan(pipe.starts, groups),
            "audit": "OK" if not problems else str(problems)[:80]}


def compare(a, tmp: Path) -> None:
    rows, got = [], {}
    for name, rule in RULES.items():
        rd = tmp / name.split(",")[0].replace(" ", "")
        if not (a.keep and (rd / "control" / "trainer_done.json").exists()):
            wall = run(CONFIG, rd, [*setting(a.jobs, a.groups, a.updates, a.time_scale), *rule])
            print(f"{name}: {wall:.0f} s wall", flush=True)
        r = got[name] = analyse(rd, a.jobs)
        rows.append([name, f"{r['step']:.1f}", f"{r['plan']:.1f}", f"{r['step'] / r['plan']:.3f}",
                     f"{r['plan_cp']:.1f}", f"{r['step'] / r['plan_cp']:.3f}",
                     f"{r['spread']:.1f} / {r['spread_plan']:.1f}", r["audit"]])
    print(f"\n{a.jobs} rollout jobs, R={a.groups} groups x 8 per update, {a.updates} updates, s=0.5 + partial, "
          f"time_scale {a.time_scale:g}; modelled seconds per update (updates 2..N)")
    print(table(["rule", "run s/update", "plan", "run / plan", "plan + cp", "run / (plan + cp)",
                 "jobs starting per version run / plan", "exactly once"], rows))
    first, auto = got["cap 16, first come"], got["auto, by load"]
    print(f"\ncap 16 / auto: run {first['step'] / auto['step']:.3f}, plan {first['plan'] / auto['plan']:.3f}, "
          f"plan + control plane {first['plan_cp'] / auto['plan_cp']:.3f}")


def elastic(a, tmp: Path) -> None:
    """A run by load grown from half the jobs to all of them after a few updates (module docstring)."""
    rd = tmp / "elastic"
    if not (a.keep and (rd / "control" / "trainer_done.json").exists()):
        proc = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(CONFIG),
                                 *setting(a.jobs // 2, a.groups, a.updates, a.time_scale), *RULES["auto, by load"],
                                 "--run-dir", str(rd), "--executor", "local", "--timeout-min", "30"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        metrics = rd / "logs" / "metrics.jsonl"
        for after, jobs in ((a.updates // 3, a.jobs), (2 * a.updates // 3, 3 * a.jobs // 4)):
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
                if proc.poll() is not None:
                    raise SystemExit(f"the elastic run ended early ({proc.returncode})")
                time.sleep(1.0)
            subprocess.run([sys.executable, "-m", "hpcrl", "scale", str(rd), "--rollout-jobs", str(jobs)], cwd=REPO,
                           check=True, capture_output=True)
        if proc.wait(timeout=3600) != 0:
            raise SystemExit("the elastic run failed")
    st = read_staleness(rd).drop_duplicates("group_id")
    m, _, _ = logs(rd)
    version_at = lambda t: int(m[m.time_s <= t].param_version.max()) if (m.time_s <= t).any() else 0  # noqa: E731
    new = sorted(w for w in st.writer.unique() if int(w[1:]) >= a.jobs // 2)
    loaded = {w: next(read_jsonl(RunDir(rd).rollout_metrics(w)))["param_version"] for w in new}  # its first version
    late = [int(st[st.writer == w].version_start.min()) - loaded[w] for w in new]
    rows = []
    for v, g in st.groupby("version_start"):
        per_job = g.writer.value_counts()
        rows.append([str(v), str(len(per_job)), f"{per_job.min()}", f"{per_job.max()}"])
    drained = [e.time_s for e in read_fleet_events(RunDir(rd)) if e.event == "drain_requested"]
    if drained:
        print(f"drain of {len(drained)} job(s) requested at version {version_at(min(drained))}")
    print(f"\nelastic: {a.jobs // 2} -> {a.jobs} -> {3 * a.jobs // 4} rollout jobs by load; {len(new)} new jobs "
          f"trained on; the first version each started groups under, after the first version it loaded: "
          f"{ {int(k): int(n) for k, n in zip(*np.unique(late, return_counts=True))} } (versions later: jobs)")
    print(table(["version", "jobs starting groups", "groups per job: least", "most"], rows))
    print(f"exactly once: {audit(RunDir(rd), 64).problems() or 'OK'}")


def main(argv=None) -> int:
    p = bench_parser(__doc__, "12 updates per run")
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--groups", type=int, default=32, help="R: groups per update (one version per update)")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--elastic", action="store_true", help="the elastic run instead (module docstring)")
    p.add_argument("--keep", action="store_true", help="keep the run directories and reuse finished ones")
    a = p.parse_args(argv)
    if a.quick:
        a.updates = 12
    folder = contextlib.nullcontext(tempfile.mkdtemp(dir=a.dir)) if a.keep and a.dir is None else \
        contextlib.nullcontext(a.dir) if a.keep else tempfile.TemporaryDirectory(dir=a.dir)
    with folder as tmp:
        print(f"run directories under {tmp}", flush=True)
        (elastic if a.elastic else compare)(a, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
