"""How a launcher asks Slurm about its jobs: one ``squeue`` for all of them per poll (``launcher/jobs.py``
``SlurmQueue``) against one ``squeue`` per job (what it did before), with 50, 200 and 800 jobs in the queue.

It needs a Slurm cluster it may submit to (``sbatch``, ``squeue``, ``scancel`` on PATH; ``SLURM_CONF`` for the
private one: ``sbatch/private-cluster.sh start DIR``, as root). The jobs are submitted held (``--hold``: they
never run) and cancelled at the end. Both ways must give the same states.

Run::

    SLURM_CONF=DIR/slurm.conf .venv/bin/python bench/bench_queue.py --quick   # 50 and 200 jobs
    SLURM_CONF=DIR/slurm.conf .venv/bin/python bench/bench_queue.py           # 50, 200 and 800 jobs
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hpcrl.launcher.jobs import JobHandle, SlurmQueue  # noqa: E402


def job_by_job(job_id: str) -> str:
    """The state as the launcher asked it before: ``squeue`` for this one job."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.split()[0] if out.stdout.strip() else "GONE"


def one_poll(ids: list[str]) -> tuple[float, float, int]:
    """(seconds job by job, seconds in one squeue, squeue calls saved) for one poll of every job."""
    t = time.perf_counter()
    before = [job_by_job(j) for j in ids]
    by_job_s = time.perf_counter() - t
    queue = SlurmQueue(refresh_s=3600)
    handles = []
    for j in ids:
        handle = JobHandle(j, SimpleNamespace(job_id=j), "slurm")
        handle.queue = queue
        queue.add(j)
        handles.append(handle)
    t = time.perf_counter()
    now = [h.state() for h in handles]
    one_s = time.perf_counter() - t
    assert before == now, f"the two ways disagree: {before[:5]} vs {now[:5]}"
    return by_job_s, one_s, len(ids) - 1


def main(argv=None) -> int:
    p = bench_parser(__doc__, "50 and 200 jobs only")
    a = p.parse_args(argv)
    sizes = [50, 200] if a.quick else [50, 200, 800]
    ids = [subprocess.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip().split(";")[0] for _ in range(max(sizes))]
    rows = []
    try:
        for n in sizes:
            runs = [one_poll(ids[:n]) for _ in range(5)]
            by_job = statistics.median(r[0] for r in runs)
            one = statistics.median(r[1] for r in runs)
            rows.append([str(n), f"{by_job * 1000:.0f}", f"{one * 1000:.1f}", f"{by_job / one:.0f}x", str(n - 1)])
    finally:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60)
    print("one poll of every job's state (median of 5; jobs held, so every state is PENDING):")
    print(table(["jobs", "squeue per job (ms)", "one squeue (ms)", "ratio", "squeue calls saved"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
