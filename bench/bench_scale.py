"""32 simulated rollout jobs on one run directory: exactly-once, the trainer keeping up, memory per job, and
the run directory's metadata load per weight version, extrapolated to 128 and 1,024 GPUs.

One run of ``configs/simulated.yaml`` with ``--jobs`` rollout jobs as local processes (``hpcrl run
--executor local``), R = one group per job per update (``actor.ppo_mini_batch_size = jobs``), one weight
version per update, checkpoints every 10 updates, s=0.5. Every process of the run imports
``bench/fsops/sitecustomize.py``, which counts its operations on the run directory (files opened for
reading and for writing, directory listings, renames, removals, mkdirs, stats, fsyncs) and its bytes
written; a sampler reads each job's memory (``/proc/PID/smaps_rollup``: RSS, PSS, private dirty).
After the run: the exactly-once audit (hpcrl/analysis/exactly_once.py), the trainer's idle ratio, and
the counts per version, split into the trainer, the rollout jobs (per job) and the launcher.

Run::

    .venv/bin/python bench/bench_scale.py --quick     # 8 jobs, 20 versions (~3 minutes)
    .venv/bin/python bench/bench_scale.py             # 32 jobs, 52 versions
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.run_dir import RunDir  # noqa: E402

OPS = ("open_write", "open_read", "listdir", "stat", "rename", "remove", "mkdir", "fsync")


def sample_memory(tag: str, peaks: dict, stop: threading.Event) -> None:
    """Every 2 s: the memory of each job process whose command line names ``tag`` (its peak is kept)."""
    while not stop.wait(2.0):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if tag not in cmd or "submitit.core._submit" not in cmd:
                    continue
                mem = dict(line.split(":") for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
            except (OSError, ValueError):
                continue
            kb = {k: int(mem[k].split()[0]) for k in ("Rss", "Pss", "Private_Dirty") if k in mem}
            role = "trainer" if cmd.rstrip().endswith("trainer") else "rollout"
            old = peaks.setdefault(pid, {"role": role, **kb})
            for k, v in kb.items():
                old[k] = max(old[k], v)


def role_of(argv: str) -> str:
    if "/trainer" in argv:
        return "trainer"
    if "/rollout-" in argv:
        return "rollout"
    return "launcher"


def main(argv=None) -> int:
    p = bench_parser(__doc__, "8 jobs, 20 versions")
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--versions", type=int, default=52)
    p.add_argument("--time-scale", type=float, default=5.0)
    a = p.parse_args(argv)
    if a.quick:
        a.jobs, a.versions = 8, 20
    tmp = Path(tempfile.mkdtemp(dir=a.dir, prefix="scale-"))
    rd, ops_dir = tmp / f"scale{a.jobs}-{os.getpid()}", tmp / "fsops"  # a unique name: job processes are found by it
    ops_dir.mkdir()
    overrides = [f"resources.rollout_jobs={a.jobs}", f"actor.ppo_mini_batch_size={a.jobs}",
                 f"actor.ppo_micro_batch_size={a.jobs}", f"rollout.total_rollout_steps={a.jobs * a.versions}",
                 "rollout.max_concurrent_groups=2", "rollout.response_length=512", "simulated.length_mean=128",
                 f"simulated.time_scale={a.time_scale}", "simulated.trainer_gpus=8",
                 "async_training.staleness_threshold=0.5", "trainer.checkpoint_every_updates=10",
                 "timeouts.wait_samples_s=1200", "timeouts.job_start_s=1500", "resources.rollout.mem_gb=1"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'bench' / 'fsops'}:{REPO}", "HPCRL_FSOPS_RUN": str(rd),
           "HPCRL_FSOPS_OUT": str(ops_dir)}
    peaks: dict = {}
    stop = threading.Event()
    threading.Thread(target=sample_memory, args=(rd.name + "-", peaks, stop), daemon=True).start()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "simulated.yaml"), *overrides,
                          "--run-dir", str(rd), "--executor", "local", "--timeout-min", "60"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    stop.set()
    if out.returncode != 0:
        raise SystemExit(f"the run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    report(a, rd, ops_dir, peaks, wall)
    return 0


def report(a, rd: Path, ops_dir: Path, peaks: dict, wall: float) -> None:
    import pandas as pd

    m = pd.read_json(rd / "logs" / "metrics.jsonl", lines=True)
    versions = int(m["param_version"].max()) + 1
    steady = float(m["time_s"].iloc[-1] - m["time_s"].iloc[0])
    au = audit(RunDir(rd), max_in_flight=2)
    print(f"run directory {rd}: {a.jobs} rollout jobs, {len(m)} updates, {versions} versions published, "
          f"wall {wall:.0f}s (steady {steady:.0f}s, {steady / max(len(m) - 1, 1):.2f}s per update)")
    print(f"exactly-once audit: {'OK' if not au.problems() else au.problems()}; {au.consumed_groups} groups consumed, "
          f"{au.unconsumed_after_cursor} committed after the final cursor")
    print(f"trainer idle ratio (updates 2..N): mean {m['trainer/idle_ratio'].iloc[1:].mean():.2f}; wait for samples "
          f"{m['timing_s/wait_samples'].iloc[1:].mean():.2f}s per update, update {m['timing_s/update'].mean():.2f}s, "
          f"publish {m['timing_s/param_sync'].mean():.3f}s")
    mem = pd.DataFrame(list(peaks.values()))
    if not mem.empty:
        for role, g in mem.groupby("role"):
            print(f"memory per {role} job (peak, MiB; {len(g)} processes): RSS {g.Rss.mean() / 1024:.0f}, "
                  f"PSS {g.Pss.mean() / 1024:.0f}, private dirty {g.Private_Dirty.mean() / 1024:.0f}")
    rows = [json.loads(p.read_text()) for p in ops_dir.glob("*.json")]
    ops = pd.DataFrame(rows)
    ops["role"] = ops.argv.map(role_of)
    per_version = ops.groupby("role")[[*OPS, "write_bytes"]].sum() / versions
    per_version.loc["rollout (per job)"] = per_version.loc["rollout"] / a.jobs
    print(f"\nrun-directory operations per weight version ({versions} versions; {steady / versions:.2f}s wall each):")
    print(table(["role", *OPS, "MB written"], [[r, *(f"{per_version.loc[r, o]:.0f}" for o in OPS),
                                                 f"{per_version.loc[r, 'write_bytes'] / 1e6:.2f}"] for r in per_version.index]))
    extrapolate(per_version, a.jobs, steady / versions * a.time_scale)


def extrapolate(per_version, jobs: int, step_model_s: float) -> None:
    """Operations per second of the metadata server at 128 and 1,024 GPUs (one engine per GPU, a quarter of the
    GPUs training), at this run's modelled step time; the rollout side grows with jobs, the trainer's polling
    of manifests with writers too (measured here per writer)."""
    per_job = per_version.loc["rollout (per job)"]
    trainer_per_writer = per_version.loc["trainer"] / jobs
    print(f"\nextrapolated (one rollout job per GPU, 3/4 of the GPUs generating, modelled step {step_model_s:.1f}s):")
    rows = []
    for gpus in (128, 1024):
        j = gpus * 3 // 4
        total = (per_job + trainer_per_writer) * j
        meta = total[["open_write", "open_read", "listdir", "stat", "rename", "remove", "mkdir"]].sum()
        rows.append([str(gpus), str(j), f"{total.open_write:.0f}", f"{total.fsync:.0f}", f"{total.listdir:.0f}",
                     f"{total.rename:.0f}", f"{meta:.0f}", f"{meta / step_model_s:.0f}",
                     f"{(per_job.write_bytes + trainer_per_writer.write_bytes) * j / 1e6:.0f}"])
    print(table(["GPUs", "rollout jobs", "files written/version", "fsyncs/version", "listdirs/version",
                 "renames/version", "metadata ops/version", "metadata ops/s", "MB/version"], rows))


if __name__ == "__main__":
    sys.exit(main())
