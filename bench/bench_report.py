"""How `hpcrl report` and `hpcrl status` scale with the length of a run's logs.

A real tiny run (local processes, ~200 groups) is made once; its logs are then
repeated end to end, with group ids, steps, versions and times shifted so that
the copies read as one long run, until the staleness log has the requested
number of rows. For each size this prints the time and peak memory of
``load_run`` (what both commands read), of the whole report (tables + PNGs) and
of ``status --once``, against the raw limit: reading the same JSONL files line by
line with ``json.loads`` and nothing else.

    .venv/bin/python bench/bench_report.py --quick           # 100k rows, under a minute
    .venv/bin/python bench/bench_report.py                   # 100k, 300k and 1M rows
"""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402
from hpcrl.rundir.fsio import JsonlAppender, read_jsonl, read_log_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOGS = ("staleness.jsonl.gz", "metrics.jsonl", "rollout-w000.jsonl")


def make_base_run(where: Path) -> Path:
    run = where / "base"
    cmd = [sys.executable, "-m", "hpcrl", "run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run),
           "--executor", "local", "rollout.total_rollout_steps=200", "async_training.staleness_threshold=0.5"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    return run


def _shift(row: dict, k: int, span: dict) -> dict:
    """Copy k of a row: ids, steps, versions and times moved past copies 0..k-1."""
    r = dict(row)
    for key in ("version_start", "version_end", "trainer_version", "param_version"):
        if key in r:
            r[key] += k * span["versions"]
    for key in ("trainer_step", "step"):
        if key in r:
            r[key] += k * span["steps"]
    if "consumed_groups" in r:
        r["consumed_groups"] += k * span["groups"]
    for key in ("created_s", "finished_s", "committed_s", "consumed_s", "time_s"):
        if key in r:
            r[key] += k * span["seconds"]
    if "group_id" in r:
        w, p = r["group_id"].split("/")
        r["group_id"] = f"{w}/{int(p) + k * span['prompts']}"
        j = r["sample_id"].rsplit("/", 1)[1]
        r["sample_id"] = f"{r['group_id']}/{j}"
    return r


def grow(base: Path, rows: int, where: Path) -> Path:
    """A run directory whose logs are copies of ``base``'s, ~``rows`` staleness rows long."""
    run = where / f"rows-{rows}"
    shutil.copytree(base, run, ignore=shutil.ignore_patterns("samples", "weights", "checkpoints", "base_model"))
    logs = {name: list(read_jsonl(base / "logs" / name)) for name in LOGS}
    st, m = logs["staleness.jsonl.gz"], logs["metrics.jsonl"]
    span = {"versions": m[-1]["param_version"] + 1, "steps": m[-1]["step"], "groups": m[-1]["consumed_groups"],
            "prompts": max(int(r["group_id"].split("/")[1]) for r in st) + 1,
            "seconds": max(r["time_s"] for r in m) - min(r["created_s"] for r in st) + 1.0}
    copies = max(1, round(rows / len(st)))
    for name, base_rows in logs.items():
        (run / "logs" / name).unlink()
        out = JsonlAppender(run / "logs" / name, fsync=False)  # the staleness log compressed, as the trainer writes it
        for k in range(copies):
            out.append_many([_shift(r, k, span) for r in base_rows])
        out.close()
    done = json.loads((run / "control" / "trainer_done.json").read_text())
    done.update(trainer_step=copies * span["steps"], consumed_groups=copies * span["groups"],
                param_version=copies * span["versions"])
    (run / "control" / "trainer_done.json").write_text(json.dumps(done))
    return run


def _measure(what: str, run: str, out: str, q) -> None:
    """In a fresh process, so that peak memory (ru_maxrss) belongs to this step alone.
    Imports happen before the clock starts: they do not grow with the logs."""
    from hpcrl.analysis.load import load_run
    from hpcrl.analysis.report import build_report
    from hpcrl.analysis.status import status_main

    def raw():
        for name in LOGS:  # the staleness log decompressed: part of the limit
            for line in read_log_bytes(Path(run) / "logs" / name).splitlines():
                json.loads(line)

    step = {"raw": raw, "load": lambda: load_run(run), "report": lambda: build_report([run], out),
            "status": lambda: status_main(Path(run), once=True, out=io.StringIO())}[what]
    t0 = time.perf_counter()
    step()
    q.put((time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def measure(what: str, run: Path, out: Path) -> tuple[float, float]:
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_measure, args=(what, str(run), str(out), q))
    p.start()
    p.join(3600)
    if p.exitcode != 0:
        raise SystemExit(f"{what} on {run} failed (exit {p.exitcode})")
    return q.get(timeout=10)


def main() -> None:
    ap = bench_parser(__doc__, "one size, 100k rows (under a minute)")
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000, 1_000_000],
                    help="staleness log sizes to measure (rows = trajectories consumed)")
    a = ap.parse_args()
    sizes = [100_000] if a.quick else a.rows
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        where = Path(tmp)
        print("making a real tiny run (200 groups) to copy from ...", flush=True)
        base = make_base_run(where)
        rows = []
        for n in sizes:
            run = grow(base, n, where)
            mb = sum((run / "logs" / x).stat().st_size for x in LOGS) / 1e6
            raw_s, raw_mb = measure("raw", run, where / "out")
            res = {w: measure(w, run, where / f"out-{n}") for w in ("load", "status", "report")}
            n_st = read_log_bytes(run / "logs" / "staleness.jsonl.gz").count(b"\n")
            rows.append([f"{n_st:,}", f"{mb:.0f}", f"{raw_s:.1f}",
                         *(f"{res[w][0]:.1f} ({res[w][0] / raw_s:.1f}x)" for w in ("load", "status", "report")),
                         f"{raw_mb:.0f} / {res['load'][1]:.0f} / {res['report'][1]:.0f}"])
            shutil.rmtree(run)
        print(table(["staleness rows", "log MB", "raw parse s", "load_run s (x raw)", "status s (x raw)",
                     "report s (x raw)", "peak RSS MB raw / load / report"], rows))
        print("raw = read the same JSONL files line by line with json.loads, nothing kept; x raw = ours / raw, "
              "measured in this run; imports are outside the clock but inside peak RSS.")


if __name__ == "__main__":
    main()
