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
import re
import statistics
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
from hpcrl.config import load_config  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

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
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override for the run (repeatable), e.g. timeouts.poll_max_s=0.25")
    p.add_argument("--sites", action="store_true",
                   help="also count each operation under the hpcrl function that caused it, and print the top ones")
    p.add_argument("--from", dest="from_dir", default=None, metavar="DIR",
                   help="report again on a finished run of this benchmark (its scale-* folder; no memory figures)")
    a = p.parse_args(argv)
    if a.from_dir is not None:
        d = Path(a.from_dir)
        run = next(x for x in d.iterdir() if x.name.startswith("scale"))
        a.jobs = load_config(run / "config.yaml").resources.rollout_jobs
        report(a, run, d / "fsops", {}, float("nan"))
        return 0
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
                 "timeouts.wait_samples_s=1200", "timeouts.job_start_s=1500", "resources.rollout.mem_gb=1",
                 *a.overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'bench' / 'fsops'}:{REPO}", "HPCRL_FSOPS_RUN": str(rd),
           "HPCRL_FSOPS_OUT": str(ops_dir), "HPCRL_FSOPS_SITES": "1" if a.sites else "0"}
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
    print(table(["role", *OPS, "MB written (process)"], [[r, *(f"{per_version.loc[r, o]:.0f}" for o in OPS),
                                                 f"{per_version.loc[r, 'write_bytes'] / 1e6:.2f}"] for r in per_version.index]))
    extrapolate(per_version, a.jobs, steady / versions, a.time_scale)
    reaction(rd)
    if "sites" in ops and ops.sites.map(bool).any():
        print_sites(ops, versions, a.jobs)


_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_PUBLISHED = re.compile(_STAMP + r".*hpcrl\.trainer: v(\d+) step .* published in")
_LOADED = re.compile(_STAMP + r".*hpcrl\.rollout: loaded weight version (\d+) in")


def _stamp(text: str) -> float:
    return time.mktime(time.strptime(text[:19], "%Y-%m-%d %H:%M:%S")) + int(text[20:]) / 1e3


def reaction(rd: Path) -> None:
    """Seconds from the trainer's publish of a version (its log line) to each rollout job's load of it (the job's
    log line): the poll's delay, the groups in flight finishing (no partial rollout here), and the load."""
    jobs = rd / "logs" / "jobs"
    published = {}
    for line in (jobs / "trainer.log").read_text().splitlines():
        if m := _PUBLISHED.match(line):
            published[int(m.group(2))] = _stamp(m.group(1))
    delays = []
    for log_path in jobs.glob("rollout-*.log"):
        for line in log_path.read_text().splitlines():
            if (m := _LOADED.match(line)) and int(m.group(2)) in published:
                delays.append(_stamp(m.group(1)) - published[int(m.group(2))])
    if not delays:
        print("\nreaction: no publish/load pairs in the job logs")
        return
    delays.sort()
    print(f"\nreaction, publish -> a rollout job's load ({len(delays)} loads): median {statistics.median(delays):.2f}s, "
          f"p90 {delays[int(0.9 * (len(delays) - 1))]:.2f}s, max {delays[-1]:.2f}s")


def print_sites(ops, versions: int, jobs: int, top: int = 25) -> None:
    """The operations per version by the hpcrl function that caused them (``--sites``), most first."""
    rows = []
    for role, g in ops.groupby("role"):
        total: dict = {}
        for sites in g.sites:
            for k, n in (sites or {}).items():
                total[k] = total.get(k, 0) + n
        per = jobs if role == "rollout" else 1
        for k, n in total.items():
            rows.append((n / versions / per, role + (" (per job)" if role == "rollout" else ""), k))
    rows.sort(reverse=True)
    print(f"\ntop {top} call sites (operations per version):")
    print(table(["ops/version", "role", "op and hpcrl function"], [[f"{n:.1f}", r, k] for n, r, k in rows[:top]]))


def extrapolate(per_version, jobs: int, step_wall_s: float, time_scale: float) -> None:
    """Metadata operations per second at 128 and 1,024 GPUs (one engine per GPU, 3/4 of the GPUs generating).
    The rollout side grows with jobs, the trainer's reading of manifests with writers (measured here per writer).
    Two readings bracket the truth: an operation driven by versions (seals, loads) happens per modelled step
    (``step_wall_s * time_scale`` on GPUs), one driven by polling (stats, listdirs, heartbeats) per wall second
    as here; the second is the load at GPU speed if every operation were a poll."""
    per_job = per_version.loc["rollout (per job)"] + per_version.loc["trainer"] / jobs
    meta_cols = ["open_write", "open_read", "listdir", "stat", "rename", "remove", "mkdir"]
    step_model_s = step_wall_s * time_scale
    print(f"\nextrapolated (one rollout job per GPU, 3/4 of the GPUs generating; a version every {step_model_s:.1f} "
          f"modelled s at GPU speed, every {step_wall_s:.2f} s here):")
    rows = []
    for gpus in (128, 1024):
        j = gpus * 3 // 4
        total = per_job * j
        meta = float(total[meta_cols].sum())
        rows.append([str(gpus), str(j), f"{total['open_write']:.0f}", f"{total['fsync']:.0f}",
                     f"{total['listdir']:.0f}", f"{total['rename']:.0f}", f"{meta:.0f}",
                     f"{meta / step_model_s:.0f}", f"{meta / step_wall_s:.0f}", f"{total['write_bytes'] / 1e6:.0f}"])
    print(table(["GPUs", "rollout jobs", "opens for writing/version", "fsyncs/version", "listdirs/version",
                 "renames/version", "metadata ops/version", "ops/s per version", "ops/s as polls",
                 "MB/version"], rows))


if __name__ == "__main__":
    sys.exit(main())
