"""Benchmark of LoRA (``actor.lora_rank``) against full fine-tuning: what a weight version costs, and the trainer's
memory.

``weights``: for the tiny model and a ~0.5B Qwen2-shaped model (hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab
151936, tied embeddings; random init, built locally), in one process so the machine's noise is shared, it publishes
and loads weight versions the way the jobs do, full weights against a LoRA adapter (the default targets: the
attention and MLP projections): ``WeightPublisher.publish`` (files hashed while written, manifest last),
``WeightSubscriber.take`` (pin, size and hash checked), and the transformers engine's ``load_weights`` (a
``load_state_dict`` of the whole model, or peft's ``set_peft_model_state_dict`` of the adapter). Bytes per version and
medians of ``--repeats`` rounds.

``memory``: the trainer's peak resident memory on the 0.5B model, full against LoRA, each in a process of its own
(``ru_maxrss``): the trainer's own model set-up (``hpcrl.trainer.parts._deepspeed``: DeepSpeed ZeRO 0, fp32, AdamW
over the trainable parameters) and one optimizer step on 4 sequences of 128 tokens; ``--kl`` adds the KL reference
(a second copy of the model for full fine-tuning, the adapter switched off for LoRA) and a forward of it.

Run (the 0.5B parts take minutes and ~10 GB; on a shared machine serialise them)::

    .venv/bin/python bench/bench_lora.py weights --quick         # the tiny model only, seconds
    flock /tmp/hpcrl-bigmem.lock .venv/bin/python bench/bench_lora.py weights
    flock /tmp/hpcrl-bigmem.lock .venv/bin/python bench/bench_lora.py memory --kl
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import bench_parser, table  # noqa: E402
from hpcrl.config.lora import DEFAULT_TARGET_MODULES  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

RANK = 16


def build_model(kind: str, folder: Path) -> Path:
    """The tiny model, or the 0.5B Qwen2-shaped one (random init, bf16 on disk as Qwen2-0.5B ships), with the tiny
    tokenizer; built once per folder."""
    from hpcrl.tiny.model import build_tiny_model, build_tokenizer

    if (folder / "config.json").exists():
        return folder
    if kind == "tiny":
        return build_tiny_model(folder, seed=0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def adapter_of(model, rank: int):
    """The model with a rank-``rank`` adapter (lora_B random, so loads copy real numbers): peft model, tensors,
    config."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(1)
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(DEFAULT_TARGET_MODULES)))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    config = pm.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    return pm, dict(get_peft_model_state_dict(pm)), config


def time_versions(rd: RunDir, engine, tensors: dict, config_json: str, repeats: int, adapter=None) -> dict:
    """Median seconds to publish, take (verified) and apply a version, and its bytes."""
    from hpcrl.config import WeightsConfig
    from hpcrl.weights import make_publisher, make_subscriber

    pub, sub = make_publisher(WeightsConfig(keep_versions=2), rd), make_subscriber(WeightsConfig(), rd, "w000")
    publish_s, take_s, apply_s, nbytes = [], [], [], 0
    for _ in range(repeats):
        v = (pub.published_versions() or [-1])[-1] + 1
        t0 = time.perf_counter()
        nbytes = pub.publish(v, tensors, config_json, v, 0, adapter=adapter).manifest.total_bytes
        t1 = time.perf_counter()
        with sub.take(v) as wv:
            t2 = time.perf_counter()
            asyncio.run(engine.load_weights(wv))
            t3 = time.perf_counter()
        pub.retain(60.0)
        publish_s.append(t1 - t0), take_s.append(t2 - t1), apply_s.append(t3 - t2)
    med = statistics.median
    return {"bytes": nbytes, "publish_s": med(publish_s), "take_s": med(take_s), "apply_s": med(apply_s),
            "total_s": med(p + t + a for p, t, a in zip(publish_s, take_s, apply_s))}


def weights(kind: str, root: Path, repeats: int) -> list[list[str]]:
    """Full and LoRA versions of one model (module docstring): table rows."""
    from hpcrl.rollout.engine import EngineOptions
    from hpcrl.rollout.transformers_engine import TransformersEngine
    from hpcrl.trainer.models import load_reference
    from hpcrl.weights.adapter import base_model_hash
    from hpcrl.weights.manifest import AdapterBase

    base = build_model(kind, root / f"model-{kind}")
    model = load_reference(base)  # fp32, as the trainer publishes
    full_state = dict(model.state_dict())
    opts = lambda r: EngineOptions(base, 8, 1.0, 1.0, "cpu", "float32", lora_rank=r)  # noqa: E731
    full = time_versions(RunDir(root / f"full-{kind}").create(), TransformersEngine(opts(0)), full_state,
                         model.config.to_json_string(), repeats)
    del full_state
    _, tensors, config = adapter_of(model, RANK)
    lora = time_versions(RunDir(root / f"lora-{kind}").create(), TransformersEngine(opts(RANK)), tensors,
                         json.dumps(config), repeats, adapter=AdapterBase(str(base), base_model_hash(base)))
    rows = []
    for name, r in (("full", full), (f"LoRA r{RANK}", lora)):
        rows.append([kind, name, f"{r['bytes'] / 1e6:.3f}", f"{r['publish_s']:.3f}", f"{r['take_s']:.3f}",
                     f"{r['apply_s']:.3f}", f"{r['total_s']:.3f}"])
    rows.append([kind, "full/LoRA", f"{full['bytes'] / lora['bytes']:.1f}x", "", "", "",
                 f"{full['total_s'] / lora['total_s']:.2f}x"])
    return rows


MEMORY_SCRIPT = r"""
import json, os, resource, sys, torch
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from hpcrl.config import load_config
from hpcrl.rundir.paths import RunDir
from hpcrl.trainer.forward import Pack
from hpcrl.trainer.parts import _deepspeed, _reference
model, rank, kl = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
over = [f"model.path={model}", "eval.every_versions=0", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1"]
over += [f"actor.lora_rank={rank}"] if rank else []
cfg = load_config("configs/tiny.yaml", over)
rd = RunDir(sys.argv[5]).create()
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
engine = _deepspeed(cfg, rd, 0, 1)[0]
after_setup = rss()
reference = _reference(cfg, rd, engine) if kl else None
ids = torch.randint(10, 1000, (4, 128), generator=torch.Generator().manual_seed(0))
# 4 rows of 128 tokens side by side; the positions 64..126 of each predict its tokens 65..127
pack = Pack(ids.reshape(1, -1), torch.arange(128).repeat(4)[None], None,
            torch.cat([torch.arange(r * 128 + 64, r * 128 + 127) for r in range(4)]), ids[:, 65:128].reshape(-1))
if reference is not None:
    with torch.no_grad():
        reference(pack, temperature=1.0, chunk_rows=1024)
logp, _, _ = engine(pack, temperature=1.0, chunk_rows=1024)
loss = -logp.mean()
engine.backward(loss)
engine.step()
trainable = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
print(json.dumps({"peak_bytes": rss(), "after_setup_bytes": after_setup, "trainable": trainable}))
"""


def memory(root: Path, kl: bool) -> list[list[str]]:
    """Peak resident memory of the trainer's set-up and one step, full against LoRA, on the 0.5B model."""
    base = build_model("0.5b", root / "model-0.5b")
    rows, peaks = [], {}
    for rank in (0, RANK):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(base), str(rank), "1" if kl else "0",
                              str(port), str(root / f"mem-run-{rank}")], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[1], env={**os.environ, "DS_ACCELERATOR": "cpu"})
        if out.returncode:
            raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
        got = json.loads(out.stdout.strip().splitlines()[-1])
        name = f"LoRA r{rank}" if rank else "full"
        peaks[name] = got["peak_bytes"]
        rows.append(["0.5b", name + (" + KL reference" if kl else ""), f"{got['trainable'] / 1e6:.1f}M",
                     f"{got['after_setup_bytes'] / 2**30:.2f}", f"{got['peak_bytes'] / 2**30:.2f}"])
    rows.append(["0.5b", "full/LoRA", "", "", f"{peaks['full'] / peaks[f'LoRA r{RANK}']:.2f}x"])
    return rows


def main() -> None:
    p = bench_parser(__doc__, "the tiny model only (weights), seconds")
    p.add_argument("what", choices=("weights", "memory"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kl", action="store_true", help="memory: with the KL reference (use_kl_loss)")
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-lora-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"host: {os.cpu_count()} cores; torch {torch.__version__}; folder {root}")
    if a.what == "weights":
        rows = []
        for kind in ("tiny",) if a.quick else ("tiny", "0.5b"):
            rows += weights(kind, root, a.repeats)
        print(table(["model", "version", "MB", "publish s", "take s", "apply s", "publish+load s"], rows))
    else:
        print(table(["model", "trainer", "trainable", "after set-up GiB", "peak GiB"], memory(root, a.kl)))


if __name__ == "__main__":
    main()
