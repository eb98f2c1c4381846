"""Benchmark of the sample exchange (HDF5 shards + manifest.jsonl) against the raw disk.

What it measures, all in one process on one disk so the machine's noise cancels
out of the ratios:

(a) write: committed groups/s through ``ShardWriter`` when sealing every G groups
    (each seal = shard built and hashed in memory, shard-N.h5.tmp written once + fsync,
    rename, fsync folder, one fsync'd
    manifest line), against writing files of exactly the same sizes with plain
    open/write/fsync/rename in the same parent folder.
(b) read: groups/s handed out by ``SampleReader`` (size + sha256 check, HDF5
    parse, offset checks, Group objects) against a plain read of the same files.
    Both read from the page cache (the files were just written; dropping caches
    needs root and would disturb the other users of this machine).
(c) commit-to-visible latency: a writer process (multiprocessing, spawn) seals
    one group at a time at a steady rate; this process polls a ``SampleReader``
    every ``--poll-ms`` and records, per group, the time it was handed out minus
    the group's ``finished_s`` (generation done) and minus its ``committed_s``.

Each write/read measurement alternates ours and raw ``--repeats`` times and
reports medians, so a burst of load from another user hits both sides.

Run::

    .venv/bin/python bench/bench_samples.py --quick          # a few seconds
    .venv/bin/python bench/bench_samples.py                  # full sizes, about a minute
    .venv/bin/python bench/bench_samples.py --dir /scratch/me --seal-groups 1,8,64 --repeats 5
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Runnable as a plain script from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import bench_parser, table  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402
from hpcrl.samples.reader import SampleReader  # noqa: E402
from hpcrl.samples.schema import Group, Trajectory  # noqa: E402
from hpcrl.rundir.fsio import file_sha256  # noqa: E402
from hpcrl.samples.writer import ShardWriter  # noqa: E402

WRITER = "w000"
DISTINCT_GROUPS = 32
"""Groups with distinct random contents; longer streams reuse their arrays (the
bytes on disk are the same size either way, and building them is not measured)."""


# ---------------------------------------------------------------- data

def make_groups(n_groups: int, n_traj: int, prompt_tokens: int, response_tokens: int,
                seed: int = 0, first_index: int = 0) -> list[Group]:
    """``n_groups`` groups with realistic dtypes and value ranges, unique prompt indices."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(min(n_groups, DISTINCT_GROUPS)):
        prompt = rng.integers(0, 150_000, prompt_tokens, dtype=np.int32)  # same prompt for the whole group
        trajs = [Trajectory(prompt_ids=prompt,
                            response_ids=rng.integers(0, 150_000, response_tokens, dtype=np.int32),
                            response_mask=(rng.random(response_tokens) < 0.9).astype(np.int8),
                            logprobs=-rng.exponential(1.0, response_tokens).astype(np.float32),
                            token_versions=np.full(response_tokens, 3, dtype=np.int32),
                            reward=float(rng.random() < 0.5))
                 for _ in range(n_traj)]
        pool.append(trajs)
    now = time.time()
    return [Group(writer=WRITER, prompt_index=first_index + i, trajectories=pool[i % len(pool)],
                  created_s=now, finished_s=now) for i in range(n_groups)]


def payload_bytes(group: Group) -> int:
    """Bytes of the arrays of one group (what any format has to store)."""
    return sum(t.prompt_ids.nbytes + t.response_ids.nbytes + t.response_mask.nbytes + t.logprobs.nbytes
               + t.token_versions.nbytes + 4 for t in group.trajectories) + 3 * 8


# ---------------------------------------------------------------- (a) write

def write_ours(root: Path, groups: list[Group], seal_groups: int) -> tuple[float, list[int]]:
    """Seconds to commit all groups through ShardWriter; the shard sizes written."""
    rd = RunDir(root).create()
    w = ShardWriter(rd, WRITER, seal_groups=seal_groups, seal_interval_s=1.0)
    sizes = []
    t0 = time.perf_counter()
    for g in groups:
        w.add(g)
        # seal on count only (not seal_due()): the interval would make the shard
        # sizes depend on how fast this machine happens to be
        if w.buffered >= seal_groups:
            sizes.append(w.seal().size_bytes)
    line = w.seal()
    if line is not None:
        sizes.append(line.size_bytes)
    w.close()
    return time.perf_counter() - t0, sizes


def write_raw(folder: Path, sizes: list[int]) -> float:
    """Seconds to write files of ``sizes`` with the minimal durable publish: write, fsync, rename."""
    folder.mkdir(parents=True)
    data = os.urandom(max(sizes))
    t0 = time.perf_counter()
    for i, n in enumerate(sizes):
        tmp = folder / f"raw-{i:06d}.bin.tmp"
        with open(tmp, "wb") as f:
            f.write(memoryview(data)[:n])
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, folder / f"raw-{i:06d}.bin")
    return time.perf_counter() - t0


def write_raw_stream(folder: Path, n_bytes: int) -> float:
    """Seconds to write ``n_bytes`` as one file + fsync: the disk's streaming limit."""
    folder.mkdir(parents=True)
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(folder / "stream.bin", "wb") as f:
        left = n_bytes
        while left > 0:
            f.write(memoryview(block)[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


# ---------------------------------------------------------------- (b) read

def read_ours(root: Path, n_groups: int) -> float:
    """Seconds for a fresh SampleReader to hand out all ``n_groups`` groups."""
    r = SampleReader(RunDir(root))
    got = 0
    t0 = time.perf_counter()
    while got < n_groups:
        if r.poll() == 0:
            raise RuntimeError(f"SampleReader sees no more groups after {got} of {n_groups} in {root}")
        got += len(r.take(n_groups - got))
    dt = time.perf_counter() - t0
    if r.skipped:
        raise RuntimeError(f"SampleReader skipped shards: {r.skipped}")
    return dt


def shard_files(root: Path) -> list[Path]:
    return sorted(RunDir(root).writer_dir(WRITER).glob("shard-*.h5"))


def read_raw(files: list[Path]) -> float:
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            f.read()
    return time.perf_counter() - t0


def read_raw_sha(files: list[Path]) -> float:
    """Plain read + sha256 (what the reader's checksum costs on its own)."""
    t0 = time.perf_counter()
    for p in files:
        file_sha256(p)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- (c) latency

def latency_writer(root: str, n_groups: int, rate_hz: float, n_traj: int, prompt_tokens: int,
                   response_tokens: int, out: mp.Queue) -> None:
    """Child process: seal one group at a time, every 1/rate_hz seconds."""
    rd = RunDir(root)
    groups = make_groups(n_groups, n_traj, prompt_tokens, response_tokens, seed=1)
    w = ShardWriter(rd, WRITER, seal_groups=1, seal_interval_s=1.0)
    seal_s = []
    next_s = time.monotonic()
    for g in groups:
        delay = next_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        next_s += 1.0 / rate_hz
        # the group is "finished" now: finished_s is what the latency is measured from
        g.created_s = g.finished_s = time.time()
        t0 = time.perf_counter()
        w.add(g)
        w.seal()
        seal_s.append(time.perf_counter() - t0)
    w.close()
    out.put(seal_s)


def measure_latency(root: Path, args) -> dict[str, list[float]]:
    rd = RunDir(root).create()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=latency_writer, args=(str(root), args.latency_groups, args.latency_rate_hz,
                                                    args.n, args.prompt_tokens, args.response_tokens, out))
    proc.start()
    reader = SampleReader(rd)
    from_finished, from_committed = [], []
    deadline = time.monotonic() + 60 + 2 * args.latency_groups / args.latency_rate_hz
    try:
        while len(from_finished) < args.latency_groups:
            if time.monotonic() > deadline:
                raise TimeoutError(f"latency bench: saw {len(from_finished)} of {args.latency_groups} groups "
                                   f"from the writer process in {root} before the deadline")
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"latency writer process died with exit code {proc.exitcode}")
            if reader.poll():
                groups = reader.take(args.latency_groups)
                seen = time.time()  # handed out = read, verified and usable by the trainer
                for g in groups:
                    from_finished.append(seen - g.finished_s)
                    from_committed.append(seen - g.committed_s)
            time.sleep(args.poll_ms / 1000)
        seal_s = out.get(timeout=60)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join()
    return {"finished -> handed out": from_finished, "committed_s -> handed out": from_committed,
            "writer seal() duration": seal_s}


# ---------------------------------------------------------------- output


def mb(n_bytes: float) -> float:
    return n_bytes / 1e6


def parse_args(argv=None):
    p = bench_parser(__doc__, "small sizes and counts (a few seconds)")
    p.add_argument("--n", type=int, default=None, help="trajectories per group (default 8, quick 4)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 128, quick 64)")
    p.add_argument("--response-tokens", type=int, default=None,
                   help="tokens per response (default 512, quick 256)")
    p.add_argument("--groups", type=int, default=None,
                   help="groups written and read per seal size (default 1024, quick 128)")
    p.add_argument("--seal-groups", default="1,4,16,64", help="comma-separated G: seal every G groups")
    p.add_argument("--repeats", type=int, default=None, help="alternating ours/raw rounds (default 3, quick 1)")
    p.add_argument("--latency-groups", type=int, default=None, help="groups in the latency test "
                   "(default 300, quick 40)")
    p.add_argument("--latency-rate-hz", type=float, default=20.0, help="groups sealed per second (latency test)")
    p.add_argument("--poll-ms", type=float, default=5.0, help="reader poll interval (latency test)")
    args = p.parse_args(argv)
    defaults = dict(n=(4, 8), prompt_tokens=(64, 128), response_tokens=(256, 512), groups=(128, 1024),
                    repeats=(1, 3), latency_groups=(40, 300))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.seal_groups = [int(x) for x in args.seal_groups.split(",")]
    for name in ("n", "prompt_tokens", "response_tokens", "groups", "repeats", "latency_groups"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(g < 1 for g in args.seal_groups):
        p.error(f"--seal-groups must all be >= 1, got {args.seal_groups}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    parent = tempfile.mkdtemp(prefix="hpcrl-bench-samples-", dir=args.dir)
    base = Path(parent)
    try:
        groups = make_groups(args.groups, args.n, args.prompt_tokens, args.response_tokens)
        per_group = payload_bytes(groups[0])
        print(f"sample exchange benchmark in {base} ({'quick' if args.quick else 'full'})")
        print(f"group = {args.n} trajectories x (prompt {args.prompt_tokens} + response {args.response_tokens} "
              f"tokens) = {per_group / 1e3:.1f} kB of arrays; {args.groups} groups per seal size; "
              f"median of {args.repeats} alternating ours/raw rounds after a warm-up")
        print("ours/raw = throughput ratio measured in this run (1.00 = as fast as the raw limit)")
        print()

        # warm-up, not reported: imports, first HDF5 file, cold directory entries
        _, sizes = write_ours(base / "warmup", groups[:16], 1)
        write_raw(base / "warmup-raw", sizes)
        read_ours(base / "warmup", 16)
        shutil.rmtree(base / "warmup")
        shutil.rmtree(base / "warmup-raw")

        write_rows, read_rows = [], []
        for G in args.seal_groups:
            ours_w, raw_w, ours_r, raw_r, raw_sha = [], [], [], [], []
            for rep in range(args.repeats):
                root = base / f"G{G}-r{rep}"
                dt, sizes = write_ours(root, groups, G)
                ours_w.append(dt)
                raw_w.append(write_raw(base / f"G{G}-r{rep}-raw", sizes))
            files = shard_files(root)  # the last round's shards are read
            file_bytes = sum(p.stat().st_size for p in files)
            for rep in range(args.repeats):
                ours_r.append(read_ours(root, args.groups))
                raw_r.append(read_raw(files))
                raw_sha.append(read_raw_sha(files))
            for rep in range(args.repeats):
                shutil.rmtree(base / f"G{G}-r{rep}")
                shutil.rmtree(base / f"G{G}-r{rep}-raw")
            ow, rw = statistics.median(ours_w), statistics.median(raw_w)
            orr, rr, rs = statistics.median(ours_r), statistics.median(raw_r), statistics.median(raw_sha)
            n_shards = len(files)
            write_rows.append([G, n_shards, f"{file_bytes / n_shards / 1e3:.1f}",
                               f"{args.groups / ow:,.0f}", f"{mb(file_bytes) / ow:.0f}",
                               f"{1e3 * ow / n_shards:.2f}", f"{mb(file_bytes) / rw:.0f}",
                               f"{1e3 * rw / n_shards:.2f}", f"{rw / ow:.2f}"])
            read_rows.append([G, f"{args.groups / orr:,.0f}", f"{mb(file_bytes) / orr:.0f}",
                              f"{mb(file_bytes) / rr:,.0f}", f"{mb(file_bytes) / rs:,.0f}", f"{rr / orr:.3f}",
                              f"{rs / orr:.2f}"])

        stream_bytes = per_group * args.groups
        stream = statistics.median(write_raw_stream(base / f"stream-{i}", stream_bytes)
                                   for i in range(args.repeats))
        for i in range(args.repeats):
            shutil.rmtree(base / f"stream-{i}")

        print("(a) write: commit groups through ShardWriter vs raw open/write/fsync/rename of the same file sizes")
        print(table(["G", "shards", "kB/shard", "ours groups/s", "ours MB/s", "ours ms/seal",
                     "raw MB/s", "raw ms/file", "ours/raw"], write_rows))
        print(f"    raw streaming limit (one {mb(stream_bytes):.0f} MB file + fsync): "
              f"{mb(stream_bytes) / stream:.0f} MB/s; payload {per_group / 1e3:.1f} kB/group")
        print()
        print("(b) read: SampleReader (one read: size+sha256 check, arrays at the manifest layout, Group objects) vs plain read of the same files")
        print("    from the page cache: the files were just written and caches cannot be dropped without root")
        print(table(["G", "ours groups/s", "ours MB/s", "raw read MB/s", "raw read+sha256 MB/s",
                     "ours/raw", "ours/(raw+sha)"], read_rows))
        print()

        print(f"(c) commit-to-visible latency: writer process seals 1 group every {1e3 / args.latency_rate_hz:.0f} ms "
              f"({args.latency_groups} groups), reader polls every {args.poll_ms:g} ms")
        lat = measure_latency(base / "latency", args)
        rows = []
        for name, xs in lat.items():
            a = 1e3 * np.asarray(xs)
            rows.append([name, len(a), f"{np.percentile(a, 50):.1f}", f"{np.percentile(a, 95):.1f}",
                         f"{a.max():.1f}"])
        print(table(["interval", "groups", "p50 ms", "p95 ms", "max ms"], rows))
        print("    committed_s is stamped before the manifest line is appended and fsync'd; "
              f"half the poll interval ({args.poll_ms / 2:g} ms) is the expected polling share")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
