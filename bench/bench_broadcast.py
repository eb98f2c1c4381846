"""Benchmark of the weight broadcast (``hpcrl.weights.broadcast``) against a raw gloo broadcast and the files.

Two processes on this machine (root = trainer rank 0, receiver = a rollout job), one gloo
group built the way the broadcast builds it (``group.make_group`` on a ``PrefixStore``
of a ``TCPStore``). For a transformer-shaped state dict (``bench_weights.make_state_dict``:
tied embedding, per-layer q/k/v/o and MLP) it measures, alternating ``--repeats`` rounds and
reporting medians:

- **ours**: ``send_buckets`` / ``recv_buckets`` for each ``--bucket-mib``: the root packs the
  tensors into two fixed-size buffers (double-buffered) and broadcasts them; the receiver
  receives into one flat buffer and builds the tensor views, as the broadcast subscriber does;
- **raw**: one ``broadcast`` of one preallocated flat uint8 tensor of the same bytes (no
  packing, no views): the limit of gloo on this machine;
- **files**: ``WeightPublisher.publish`` + ``WeightSubscriber.take`` (copy into preallocated parameters)
  of the same state dict in the root process (page cache, see bench_weights.py).

Each broadcast round is timed on the root from a barrier before it to a barrier after it (the
receiver has everything). ``ours / raw`` is the figure to compare across machines (target
>= 0.9). Loopback TCP between two processes on a shared 2-core machine is what is measured
here: no NCCL figure (that needs two GPUs) and no network between nodes.

Run::

    .venv/bin/python bench/bench_broadcast.py --quick     # 64 MB, a few seconds
    .venv/bin/python bench/bench_broadcast.py             # 300 MB bf16, buckets 16/64/256 MB
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, table  # noqa: E402
from bench_weights import DTYPES, make_state_dict, time_load, time_publish  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402
from hpcrl.weights.publisher import WeightPublisher, dedupe_tied
from hpcrl.weights.subscriber import WeightSubscriber  # noqa: E402
from hpcrl.weights.group import make_group  # noqa: E402
from hpcrl.weights.wire import Entry, broadcast_async, plan, recv_buckets, send_buckets  # noqa: E402

TIMEOUT_S = 300.0


def rounds(group, rank: int, total: int, entries, tensors, buckets_mb: list[float], repeats: int) -> dict:
    """Both processes run the same sequence; the root returns the timings."""
    flat = torch.empty(total, dtype=torch.uint8)
    if rank == 0:
        flat.random_(0, 255)
    buffers, out = None, torch.empty(total, dtype=torch.uint8)  # kept across rounds, as the broadcast keeps them
    times: dict[str, list[float]] = {"raw": [], **{f"ours {b:g} MB": [] for b in buckets_mb}}
    for _ in range(repeats):
        for name in times:
            group.barrier().wait()
            t0 = time.perf_counter()
            if name == "raw":
                broadcast_async(group, flat).wait()
            elif rank == 0:
                buffers = send_buckets(group, tensors, entries, total, int(float(name.split()[1]) * 2**20), buffers)
            else:
                recv_buckets(group, entries, total, int(float(name.split()[1]) * 2**20), out)
            group.barrier().wait()
            times[name].append(time.perf_counter() - t0)
    return times


def receiver(port: int, repeats: int, buckets_mb: list[float]) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=TIMEOUT_S))
    store.wait(["plan"])
    p = json.loads(store.get("plan"))
    group = make_group(store, "bench", 1, 2, TIMEOUT_S, "gloo")
    rounds(group, 1, p["total"], [Entry(*e) for e in p["entries"]], None, buckets_mb, repeats)


def root(size_mb: float, dtype: torch.dtype, repeats: int, buckets_mb: list[float], base: Path) -> dict:
    sd, config = make_state_dict(int(size_mb * 1e6), dtype)
    tensors, _ = dedupe_tied(sd)
    entries, total = plan(tensors)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    store.set("plan", json.dumps({"total": total, "entries": [[e.name, e.dtype, e.shape, e.offset_bytes, e.nbytes]
                                                             for e in entries]}))
    child = subprocess.Popen([sys.executable, __file__, "--receiver", str(store.port), "--repeats", str(repeats),
                              "--bucket-mib", *map(str, buckets_mb)])
    try:
        group = make_group(store, "bench", 0, 2, TIMEOUT_S, "gloo")
        times = rounds(group, 0, total, entries, tensors, buckets_mb, repeats)
    except BaseException:
        child.kill()  # it would wait for the next broadcast until its timeout
        raise
    if child.wait(TIMEOUT_S) != 0:
        raise RuntimeError(f"receiver exited {child.returncode}")
    run = Path(tempfile.mkdtemp(prefix="bench_broadcast_", dir=base))
    try:
        rd = RunDir(run).create()
        wt, sub = WeightPublisher(rd, keep_versions=2), WeightSubscriber(rd, "w000")
        params = {k: torch.empty_like(v) for k, v in sd.items()}
        times["files (publish + load)"] = []
        for v in range(repeats):
            times["files (publish + load)"].append(time_publish(wt, v, sd, json.dumps(config)) + time_load(sub, v, params))
            wt.retain(heartbeat_stale_s=60)
    finally:
        shutil.rmtree(run, ignore_errors=True)
    return {"total_bytes": total, **{k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    p = bench_parser(__doc__, "64 MB, buckets 4/16/64 MB, 3 repeats")
    p.add_argument("--size-mb", type=float, default=300.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--bucket-mib", type=float, nargs="+", default=[16.0, 64.0, 256.0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--receiver", type=int, default=None, help=argparse_hidden())
    a = p.parse_args(argv)
    if a.receiver is not None:
        receiver(a.receiver, a.repeats, a.bucket_mib)
        return 0
    if a.quick:
        a.size_mb, a.bucket_mib, a.repeats = 64.0, [4.0, 16.0, 64.0], 3
    torch.set_num_threads(1)
    r = root(a.size_mb, DTYPES[a.dtype], a.repeats, a.bucket_mib, Path(a.dir or tempfile.gettempdir()))
    gb = r.pop("total_bytes") / 1e9
    raw = r["raw"]
    rows = [[name, f"{s * 1e3:.0f}", f"{gb / s:.2f}", f"{raw / s:.2f}"] for name, s in r.items()]
    print(f"{gb * 1e3:.0f} MB ({a.dtype}), 2 processes on this machine (gloo over loopback TCP), "
          f"median of {a.repeats}")
    print(table(["path", "ms", "GB/s", "raw / path time (= path / raw rate)"], rows))
    return 0


def argparse_hidden() -> str:
    """Help text of the internal --receiver flag."""
    return "internal: run as the receiving process, connecting to this store port"


if __name__ == "__main__":
    sys.exit(main())
