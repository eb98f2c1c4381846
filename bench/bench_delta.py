"""Delta weight versions (``weights.delta``) against full ones, on a real-size model's real updates.

A Qwen2-shaped model of ~0.5B parameters (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate
4864, vocab 151936, tied embeddings: Qwen2.5-0.5B's shape) is built locally with random weights and trained
``--steps`` steps with the trainer's own optimizer set-up (``hpcrl/trainer/parts.py``: torch AdamW under
DeepSpeed, bf16 on, so fp32 master weights and a bf16 model, ZeRO 0, one CPU rank over gloo) at each
learning rate of ``--lrs`` (RL's 1e-6 and 1e-5). The loss is next-token cross-entropy on random tokens: the
gradient's direction hardly matters to what changes, since Adam's step is ~lr per element whatever the
gradient's scale. Version k is the bf16 model after k steps; version 0 is the base.

For every version it measures, in one process on one disk (ratios in one run):

- the share of bf16 elements that differ from the previous version and from the base (what a delta
  against the base carries);
- bytes per version: full (``model.safetensors``) vs delta (``model.delta``: XOR against the base, zstd
  level 1) vs the other encoding we considered, sparse indices + values (int32 positions, delta-coded, and
  the new values, zstd level 1), encoded here only to compare size and time;
- publish seconds (``WeightPublisher.publish``: full, and delta with the base in the trainer's memory)
  and load seconds (``WeightSubscriber.take`` + a copy into preallocated parameters, as the rollout job
  does: full; delta with the base held in memory; delta for a reader that must read the base first), each
  against a raw write (write, fsync, rename) and read of the same number of bytes;
- the extrapolation to a 7B model (7.6e9 parameters, bf16) and 64 rollout jobs: bytes the filesystem serves
  per version, full vs delta, and over a cycle of ``weights.full_every`` = 10 versions (one full, nine
  deltas, each reader reading the full one once).

The page cache is not dropped (root only, and the machine is shared): reads come from memory, so the read
side measures software cost (decompression, XOR, hashing), not the disk; on Lustre the bytes saved are the
point. The training runs in a process of its own (DeepSpeed holds ~11 GB: fp32 masters, Adam's two moments,
fp32 gradients), which writes each version to disk and exits before the measuring (~6 GB). Run it alone
(``flock /tmp/hpcrl-bigmem.lock`` serialises it with other big jobs).

Run::

    flock /tmp/hpcrl-bigmem.lock .venv/bin/python bench/bench_delta.py --steps 9 --results delta.json   # ~40 min
    .venv/bin/python bench/bench_delta.py --quick                      # a 12M model of the same shape, ~2 min
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_weights import raw_read, raw_write  # noqa: E402
from hpcrl.rundir.paths import WEIGHT_DELTA, WEIGHT_TENSORS, RunDir  # noqa: E402
from hpcrl.weights.delta import ZSTD_LEVEL, bits, changed_elements  # noqa: E402
from hpcrl.weights.delta_versions import DeltaWriter  # noqa: E402
from hpcrl.weights.publisher import WeightPublisher
from hpcrl.weights.subscriber import WeightSubscriber  # noqa: E402

SHAPES = {"0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
          "quick": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=32000)}
PARAMS_7B = 7.6e9
"""Qwen2.5-7B's parameters."""
READERS = 64


def build_model(shape: dict, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, max_position_embeddings=512, tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def deepspeed_engine(model, lr: float):
    """The trainer's set-up (``trainer/parts.py``): torch AdamW under DeepSpeed with bf16, ZeRO 0, one gloo rank."""
    import deepspeed
    import torch.distributed as dist

    from hpcrl.process.network import free_port

    if not dist.is_initialized():  # (a process of its own: train())
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        deepspeed.init_distributed(dist_backend="gloo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
        "steps_per_print": 10**9})
    return engine


def train_step(engine, vocab: int, tokens: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def bf16_state(engine) -> dict[str, torch.Tensor]:
    """The policy as the trainer publishes it: bf16, the tied lm_head left out (stored once, as publish does)."""
    return {k: v.detach() for k, v in engine.module.state_dict().items() if k != "lm_head.weight"}


def train(shape: dict, lr: float, steps: int, tokens: int, out: Path) -> None:
    """Versions 0..steps of the model trained at ``lr``, as ``out/vK.safetensors`` and ``out/vK.json`` (loss and
    step seconds). Run in a process of its own: DeepSpeed's ~10 GB go back to the system before the measuring."""
    from safetensors.torch import save_file

    engine = deepspeed_engine(build_model(shape), lr)
    save_file(bf16_state(engine), str(out / "v0.safetensors"))
    for v in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = train_step(engine, shape["vocab_size"], tokens, seed=v)
        (out / f"v{v}.json").write_text(json.dumps({"loss": loss, "train_s": time.perf_counter() - t0}))
        save_file(bf16_state(engine), str(out / f"v{v}.safetensors"))
        print(f"  lr {lr:g} v{v}: loss {loss:.3f}, step {time.perf_counter() - t0:.1f}s", flush=True)


def version(out: Path, v: int) -> dict[str, torch.Tensor]:
    """Version ``v`` as the trainer hands it to publish (the tied lm_head an alias of the embedding)."""
    from safetensors.torch import load_file

    sd = load_file(str(out / f"v{v}.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def sparse_size(base: dict, new: dict) -> tuple[int, float]:
    """Bytes and seconds of the alternative encoding: per tensor the changed positions (int32, delta-coded)
    and their new values, zstd level 1."""
    import zstandard

    t0, n = time.perf_counter(), 0
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    for k, t in new.items():
        idx = torch.nonzero(bits(base[k]) != bits(t)).reshape(-1).to(torch.int64)
        gaps = torch.diff(idx, prepend=torch.zeros(1, dtype=torch.int64)).to(torch.int32)
        vals = t.reshape(-1)[idx].contiguous()
        n += len(cctx.compress(gaps.numpy().tobytes())) + len(cctx.compress(vals.view(torch.uint8).numpy().tobytes()))
    return n, time.perf_counter() - t0


def load_into(sub: WeightSubscriber, version: int, params: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with sub.take(version) as wv:
        for k, dst in params.items():
            dst.copy_(wv.tensors[k])
    return time.perf_counter() - t0


def raw_pair(folder: Path, nbytes: int) -> tuple[float, float]:
    data = bytearray(os.urandom(1 << 20)) * -(-nbytes // (1 << 20))
    w = raw_write(folder, memoryview(data)[:nbytes])
    del data
    r = raw_read(folder, bytearray(nbytes))
    (folder / "raw.bin").unlink()
    return w, r


def one_lr(parent: Path, shape: dict, lr: float, steps: int, tokens: int, quick: bool) -> dict:
    """Train ``steps`` steps at ``lr`` (a subprocess), then publish every version full and as a delta and load
    each as the rollout job does; the measurements."""
    out = parent / f"versions-{lr:g}"
    out.mkdir()
    cmd = [sys.executable, __file__, "--train-into", str(out), "--lrs", str(lr), "--steps", str(steps),
           "--tokens", str(tokens)] + (["--quick"] if quick else [])
    subprocess.run(cmd, check=True)
    config_json = json.dumps({"model_type": "qwen2"})
    rd_full, rd_delta = RunDir(parent / f"full-{lr:g}").create(), RunDir(parent / f"delta-{lr:g}").create()
    raw_dir = parent / "raw"
    raw_dir.mkdir(exist_ok=True)
    # every version after v0 a delta (to measure each); the run's default would write v10 full
    full_pub = WeightPublisher(rd_full, keep_versions=2)
    delta_pub = WeightPublisher(rd_delta, keep_versions=2, deltas=DeltaWriter(steps + 1, 1.0))
    full_sub = WeightSubscriber(rd_full, "w000")
    follower, newcomer = WeightSubscriber(rd_delta, "w000", keep_bases=True), WeightSubscriber(rd_delta, "w001")
    state = version(out, 0)
    params = {k: torch.empty_like(v) for k, v in state.items()}
    delta_pub.publish(0, state, config_json, 0, 0)
    full_pub.publish(0, state, config_json, 0, 0)
    load_into(follower, 0, params)  # the follower holds the base from here on
    base = delta_pub.deltas.base.tensors  # the trainer's copy of v0 (memory is tight: no copy of our own)
    prev, rows = state, []
    for v in range(1, steps + 1):
        state = version(out, v)
        stored = [k for k in state if k != "lm_head.weight"]
        n = sum(state[k].numel() for k in stored)
        changed_prev = sum(changed_elements(prev[k], state[k]) for k in stored)
        changed_base = sum(changed_elements(base[k], state[k]) for k in stored)
        prev = None
        t0 = time.perf_counter()
        full_pub.publish(v, state, config_json, v, 0)
        pub_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        delta_pub.publish(v, state, config_json, v, 0)
        pub_delta = time.perf_counter() - t0
        full_bytes = rd_full.weight_file(v, WEIGHT_TENSORS).stat().st_size
        delta_bytes = rd_delta.weight_file(v, WEIGHT_DELTA).stat().st_size
        load_full = load_into(full_sub, v, params)
        load_delta = load_into(follower, v, params)
        newcomer.deltas.base = None  # a reader that lacks the base: a new or restarted job
        load_new = load_into(newcomer, v, params)
        newcomer.deltas.base, newcomer.deltas._spare = None, None  # (its memory back)
        sparse_bytes, sparse_s = sparse_size(base, {k: state[k] for k in stored})
        raw_w_full, raw_r_full = raw_pair(raw_dir, full_bytes)
        raw_w_delta, raw_r_delta = raw_pair(raw_dir, delta_bytes)
        trained = json.loads((out / f"v{v}.json").read_text())
        rows.append(dict(version=v, loss=trained["loss"], train_s=trained["train_s"], n=n, changed_prev=changed_prev,
                         changed_base=changed_base, full_bytes=full_bytes, delta_bytes=delta_bytes,
                         sparse_bytes=sparse_bytes, sparse_s=sparse_s, pub_full=pub_full, pub_delta=pub_delta,
                         load_full=load_full, load_delta=load_delta, load_new=load_new, raw_w_full=raw_w_full,
                         raw_r_full=raw_r_full, raw_w_delta=raw_w_delta, raw_r_delta=raw_r_delta))
        for pub in (full_pub, delta_pub):
            pub.retain(heartbeat_stale_s=5)
        (out / f"v{v - 1}.safetensors").unlink()
        prev = state
        print(f"  lr {lr:g} v{v}: {changed_prev / n:.2%} changed since v{v - 1}, {changed_base / n:.2%} since v0, "
              f"delta {delta_bytes / 1e6:.1f} MB of {full_bytes / 1e6:.1f}", flush=True)
    shutil.rmtree(out)
    shutil.rmtree(rd_full.root)
    shutil.rmtree(rd_delta.root)
    return {"lr": lr, "rows": rows}


def report(results: list[dict], params_model: int) -> None:
    print("\nper version (changed = bf16 elements whose bits differ; delta and sparse are against v0):")
    rows = []
    for res in results:
        for r in res["rows"]:
            rows.append([f"{res['lr']:g}", r["version"], f"{r['changed_prev'] / r['n']:.2%}",
                         f"{r['changed_base'] / r['n']:.2%}", f"{r['full_bytes'] / 1e6:.0f}",
                         f"{r['delta_bytes'] / 1e6:.1f}", f"{r['full_bytes'] / r['delta_bytes']:.1f}x",
                         f"{r['sparse_bytes'] / 1e6:.1f}"])
    print(table(["lr", "version", "changed vs previous", "changed vs v0", "full MB", "delta MB", "full/delta",
                 "sparse MB"], rows))
    print("\nseconds (median over the versions; raw = write+fsync+rename / read of the same bytes):")
    rows = []
    for res in results:
        m = {k: statistics.median(r[k] for r in res["rows"]) for k in res["rows"][0] if k != "version"}
        full_pl, delta_pl = m["pub_full"] + m["load_full"], m["pub_delta"] + m["load_delta"]
        rows.append([f"{res['lr']:g}", f"{m['pub_full']:.2f}", f"{m['raw_w_full']:.2f}", f"{m['pub_delta']:.2f}",
                     f"{m['raw_w_delta']:.2f}", f"{m['load_full']:.2f}", f"{m['raw_r_full']:.2f}",
                     f"{m['load_delta']:.2f}", f"{m['load_new']:.2f}", f"{m['raw_r_delta']:.3f}",
                     f"{delta_pl / full_pl:.2f}", f"{m['sparse_s']:.2f}"])
    print(table(["lr", "publish full", "raw write full", "publish delta", "raw write delta", "load full",
                 "raw read full", "load delta (base held)", "load delta (base read)", "raw read delta",
                 "(pub+load) delta/full", "sparse encode"], rows))
    print(f"\nextrapolated to a 7B model ({PARAMS_7B:.1e} bf16 parameters) and {READERS} rollout jobs reading each "
          f"version from the filesystem (bytes scaled by parameters; cycle = weights.full_every=10: one full "
          "version and nine deltas, the deltas of the cycle's versions 1-9 taken as this run's mean):")
    rows = []
    scale = PARAMS_7B / params_model
    for res in results:
        full = statistics.mean(r["full_bytes"] for r in res["rows"]) * scale
        delta = statistics.mean(r["delta_bytes"] for r in res["rows"]) * scale
        writes_cycle, reads_cycle = full + 9 * delta, READERS * (full + 9 * delta)
        rows.append([f"{res['lr']:g}", f"{full / 1e9:.1f}", f"{delta / 1e9:.2f}",
                     f"{(READERS + 1) * full / 1e12:.2f}", f"{(READERS + 1) * delta / 1e12:.3f}",
                     f"{(writes_cycle + reads_cycle) / 10 / 1e12:.3f}",
                     f"{(READERS + 1) * full / ((writes_cycle + reads_cycle) / 10):.1f}x"])
    print(table(["lr", "full GB", "delta GB", "TB/version full", "TB/version delta", "TB/version over a cycle",
                 "saving over a cycle"], rows))


def main(argv=None) -> int:
    p = bench_parser(__doc__, "a ~12M-parameter model of the same structure (minutes)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (= versions after v0) per learning rate")
    p.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    p.add_argument("--tokens", type=int, default=128, help="tokens per training step")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="keep each learning rate's measurements in this JSON file as it finishes, and report every "
                        "rate the file holds (a rate it holds already is not measured again)")
    p.add_argument("--train-into", default=None, help=argparse.SUPPRESS)  # the training subprocess
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    shape = SHAPES["quick" if a.quick else "0.5b"]
    torch.set_num_threads(os.cpu_count() or 1)
    if a.train_into is not None:
        train(shape, float(a.lrs), a.steps, a.tokens, Path(a.train_into))
        return 0
    parent = Path(tempfile.mkdtemp(prefix="hpcrl-bench-delta-", dir=a.dir))
    try:
        n_params = sum(p.numel() for p in build_model(shape).parameters())
        print(f"delta weight versions: Qwen2-shaped model, {n_params / 1e6:.0f}M parameters (tied embedding), bf16 "
              f"published, {a.steps} DeepSpeed bf16 AdamW steps per learning rate ({a.tokens} tokens each); in "
              f"{parent}; {os.cpu_count()} CPUs; page cache not dropped")
        saved = Path(a.results) if a.results else None
        results = json.loads(saved.read_text()) if saved is not None and saved.exists() else []
        for lr in map(float, a.lrs.split(",")):
            if any(r["lr"] == lr for r in results):
                print(f"  lr {lr:g}: measured already in {saved}")
                continue
            results.append(one_lr(parent, shape, lr, a.steps, a.tokens, a.quick))
            if saved is not None:
                saved.write_text(json.dumps(results))
        report(sorted(results, key=lambda r: r["lr"]), n_params)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
