"""Benchmark of the weight exchange through files (``hpcrl.weights.filesystem``) against the raw disk.

For state dicts shaped like a transformer (tied embedding, per layer q/k/v/o
and gate/up/down, norms) of a few total sizes it measures, in one process on one
disk so the machine's noise cancels out of the ratios:

- ``WeightPublisher.publish`` (safetensors streamed into vNNNNNN.tmp and
  hashed (xxh3_128) while written, config.json, fsync, rename, manifest.json
  last), also with ``checksum=False`` to show what the hash costs;
- ``WeightSubscriber.take`` as the rollout job uses it: announce "loading",
  check sizes, map the file, hash it against the manifest, then copy every
  tensor into preallocated parameters inside ``apply`` (what
  ``engine.load_weights`` does), then announce "loaded"; also with
  ``verify=False`` to show what verifying every load costs (issue #14);
- the raw limit: the same number of bytes written with open/write/fsync/rename
  into the same folder, and read back with a plain ``readinto`` into a
  preallocated buffer.

Both sides read from the page cache (the files were just written; dropping
caches needs root and would disturb the other users of this machine), so the
read side measures software overhead, not the disk. Every size alternates
ours and raw ``--repeats`` times and reports medians.

Run::

    .venv/bin/python bench/bench_weights.py --quick          # a few seconds
    .venv/bin/python bench/bench_weights.py                  # 10, 100, 500 MB, under a minute
    .venv/bin/python bench/bench_weights.py --dir /scratch/me --sizes-mb 1000 --dtype float32
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Runnable as a plain script from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import bench_parser, table  # noqa: E402
from hpcrl.rundir.paths import WEIGHT_TENSORS, RunDir  # noqa: E402
from hpcrl.weights.publisher import WeightPublisher
from hpcrl.weights.subscriber import WeightSubscriber  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---------------------------------------------------------------- data

def make_state_dict(total_bytes: int, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """A transformer-shaped state dict of about ``total_bytes``, and its config.

    hidden h is the largest power of two that still gives >= 4 layers; a layer
    is 4 h^2 (attention) + 3 * 4h * h (MLP) + 2 h (norms) elements; the embedding
    (tied with lm_head, stored once) takes the remainder.
    """
    elt = torch.finfo(dtype).bits // 8
    hidden = 2 ** max(6, int(math.log2(math.sqrt(total_bytes / (16 * elt * 4)))))
    ffn = 4 * hidden
    layer_elems = 4 * hidden * hidden + 3 * ffn * hidden + 2 * hidden
    n_layers = max(1, min(total_bytes // (layer_elems * elt), 64))
    vocab = max(hidden, (total_bytes // elt - n_layers * layer_elems - hidden) // hidden)
    # Random contents for one layer, copies for the others (distinct storages, so
    # nothing is deduplicated; generating 500 MB of randn would take seconds).
    g = torch.Generator().manual_seed(0)
    proto = {
        "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden), "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
    }
    proto = {k: (torch.randn(shape, generator=g) * 0.02).to(dtype) for k, shape in proto.items()}
    sd = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(dtype)}
    for i in range(n_layers):
        for k, v in proto.items():
            sd[f"model.layers.{i}.{k}"] = v.clone()
    sd["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied: publish stores it once, as an alias
    config = {"hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": n_layers,
              "vocab_size": vocab, "tie_word_embeddings": True, "torch_dtype": str(dtype).removeprefix("torch.")}
    return sd, config


def stored_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for k, t in sd.items() if k != "lm_head.weight")


# ---------------------------------------------------------------- ours

def time_publish(wt: WeightPublisher, version: int, sd: dict, config_json: str) -> float:
    t0 = time.perf_counter()
    wt.publish(version, sd, config_json, trainer_step=version, consumed_groups=0)
    return time.perf_counter() - t0


def time_load(sub: WeightSubscriber, version: int, params: dict[str, torch.Tensor]) -> float:
    """Seconds for ``take`` as the rollout job calls it: announce, check sizes, map and (if the
    subscriber verifies) hash the file, copy into ``params`` as the engine does, release the announcement."""
    t0 = time.perf_counter()
    with sub.take(version) as wv:
        if set(wv.tensors) != set(params) or wv.manifest.param_version != version:
            raise RuntimeError(f"take({version}) gave version {wv.version} with {len(wv.tensors)} tensors, expected "
                               f"{len(params)}")
        for k, dst in params.items():
            dst.copy_(wv.tensors[k])
    return time.perf_counter() - t0


# ---------------------------------------------------------------- raw

def raw_write(folder: Path, data: memoryview) -> float:
    """Seconds to write ``data`` with the minimal durable publish: write, fsync, rename."""
    tmp, final = folder / "raw.bin.tmp", folder / "raw.bin"
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    return time.perf_counter() - t0


def raw_read(folder: Path, buf: bytearray) -> float:
    """Seconds to read the raw file back into a preallocated buffer (one copy, like ours)."""
    t0 = time.perf_counter()
    with open(folder / "raw.bin", "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise RuntimeError(f"{folder / 'raw.bin'} is shorter than the {len(buf)} bytes written")
            got += n
    return time.perf_counter() - t0


# ---------------------------------------------------------------- run

def bench_size(base: Path, size_mb: float, dtype: torch.dtype, repeats: int) -> dict:
    sd, config = make_state_dict(int(size_mb * 1e6), dtype)
    config_json = json.dumps(config)
    params = {k: torch.empty_like(v) for k, v in sd.items()}  # the rollout engine's parameters
    rd = RunDir(base / f"run-{size_mb:g}MB").create()
    raw_dir = rd.weights / "raw"
    raw_dir.mkdir()
    res = {k: [] for k in ("publish", "publish_nock", "load", "load_noverify", "raw_write", "raw_read")}
    wt, sub = WeightPublisher(rd, keep_versions=2), WeightSubscriber(rd, "w000")
    wt_nock, sub_noverify = WeightPublisher(rd, keep_versions=2, checksum=False), WeightSubscriber(rd, "w000",
                                                                                                       verify=False)
    file_bytes = 0
    # round 0 is a warm-up (first-touch allocations, cold directory entries), not reported
    for rep in range(repeats + 1):
        v = 2 * rep
        res["publish"].append(time_publish(wt, v, sd, config_json))
        assert sub.newest_usable() == v
        res["load"].append(time_load(sub, v, params))
        res["publish_nock"].append(time_publish(wt_nock, v + 1, sd, config_json))
        res["load_noverify"].append(time_load(sub_noverify, v, params))  # same file, hashed on publish
        file_bytes = rd.weight_file(v, WEIGHT_TENSORS).stat().st_size
        # Raw data built outside the timing; same byte count as the safetensors file.
        data = bytearray(os.urandom(1 << 20)) * math.ceil(file_bytes / (1 << 20))
        res["raw_write"].append(raw_write(raw_dir, memoryview(data)[:file_bytes]))
        res["raw_read"].append(raw_read(raw_dir, bytearray(file_bytes)))
        del data
        # keep the disk and the page cache from filling up over the rounds
        for version in (v, v + 1):
            shutil.rmtree(rd.weight_version_dir(version))
        (raw_dir / "raw.bin").unlink()
    shutil.rmtree(rd.root)
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    med.update(file_bytes=file_bytes, n_tensors=len(sd), hidden=config["hidden_size"],
               layers=config["num_hidden_layers"], stored_bytes=stored_bytes(sd))
    return med



def parse_args(argv=None):
    p = bench_parser(__doc__, "small sizes (a few seconds)")
    p.add_argument("--sizes-mb", default=None, help="comma-separated state dict sizes in MB "
                   "(default 10,100,500; quick 2,10,50)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--repeats", type=int, default=None, help="alternating ours/raw rounds (default 5, quick 2)")
    args = p.parse_args(argv)
    if args.sizes_mb is None:
        args.sizes_mb = "2,10,50" if args.quick else "10,100,500"
    args.sizes_mb = [float(x) for x in args.sizes_mb.split(",")]
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(s <= 0 for s in args.sizes_mb):
        p.error(f"--sizes-mb must all be > 0, got {args.sizes_mb}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # the raw read is one thread; a one-thread copy keeps the load ratio like for like
    torch.set_num_threads(1)
    parent = tempfile.mkdtemp(prefix="hpcrl-bench-weights-", dir=args.dir)
    try:
        print(f"weight exchange benchmark in {parent} ({'quick' if args.quick else 'full'}), {args.dtype}, "
              f"median of {args.repeats} alternating ours/raw rounds after a warm-up round")
        print("page cache NOT dropped (needs root): loads and raw reads both come from memory, "
              "so the read side measures software overhead, not the disk")
        print()
        rows, ck_rows, shape_rows = [], [], []
        for size_mb in args.sizes_mb:
            r = bench_size(Path(parent), size_mb, DTYPES[args.dtype], args.repeats)
            mbytes = r["file_bytes"] / 1e6
            ours, raw = r["publish"] + r["load"], r["raw_write"] + r["raw_read"]
            shape_rows.append([f"{mbytes:.1f}", r["n_tensors"], r["hidden"], r["layers"]])
            rows.append([f"{mbytes:.1f}", f"{1e3 * r['publish']:.0f}", f"{1e3 * r['raw_write']:.0f}",
                         f"{r['publish'] / r['raw_write']:.2f}",
                         f"{1e3 * r['load']:.0f}", f"{1e3 * r['raw_read']:.0f}",
                         f"{r['load'] / r['raw_read']:.2f}", f"{ours / raw:.2f}",
                         f"{mbytes / r['publish']:.0f}", f"{mbytes / r['raw_write']:.0f}"])
            ck_rows.append([f"{mbytes:.1f}", f"{1e3 * r['publish']:.0f}", f"{1e3 * r['publish_nock']:.0f}",
                            f"{1e3 * (r['publish'] - r['publish_nock']):.0f}",
                            f"{(r['publish'] - r['publish_nock']) / r['publish']:.0%}",
                            f"{r['publish_nock'] / r['raw_write']:.2f}",
                            f"{1e3 * r['load']:.0f}", f"{1e3 * r['load_noverify']:.0f}",
                            f"{1e3 * (r['load'] - r['load_noverify']):.0f}",
                            f"{(r['load'] - r['load_noverify']) / r['load']:.0%}"])
        print("state dicts (tied embedding stored once):")
        print(table(["MB", "tensors", "hidden", "layers"], shape_rows))
        print()
        print("publish and load vs raw (times in ms; ratios are time ours / time raw, 1.00 = raw limit, "
              "higher = slower)")
        print(table(["MB", "publish", "raw write", "pub/raw", "load", "raw read",
                     "load/raw", "(pub+load)/(raw w+r)", "publish MB/s", "raw w MB/s"], rows))
        print("    load = WeightSubscriber.take + copy into preallocated params, as the rollout job does")
        print()
        print("hash cost (xxh3_128): computed while publishing; verified on every load before apply")
        print(table(["MB", "publish ms", "no-hash ms", "hash ms", "share", "no-hash/raw write",
                     "load ms", "no-verify ms", "verify ms", "share"], ck_rows))
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
