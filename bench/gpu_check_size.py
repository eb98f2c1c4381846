"""A real-size step for ``bench/gpu_check.sh``: a ~0.5B Qwen2-shaped model trained for a handful of updates while
vLLM generates responses of hundreds of tokens, trainer and engine sharing this node's GPU.

    python bench/gpu_check_size.py RUN_DIR OUT.json [--size 0.5b|small] [--updates N] [--tokens T]
                                   [--vllm-memory F] [key=value ...]

The model is built here (random init, no download) in the shape of Qwen2.5-0.5B: hidden 896, 24 layers,
14 query / 2 KV heads, intermediate 4864, vocab 151936, tied embeddings (494M parameters, 0.99 GB in bf16),
with a word-level tokenizer whose first 64 words are the tiny task's (its prompts and reward work; the other
words are fillers). The run is ``hpcrl run configs/tiny.yaml`` with ``rollout.engine=vllm``, weights by
broadcast, DeepSpeed ZeRO-2, bf16 on both sides (``auto``), ``--updates`` updates of 4 groups x 8 responses of
up to ``--tokens`` tokens (the random model rarely stops early), vLLM given ``--vllm-memory`` of the GPU and
the trainer the rest. Then the exactly-once audit.

Figures (medians over the updates after the first, which pays for compilation and caches): per update the
trainer's wait for samples (generation, on-policy), update and publish seconds (gather, files, broadcast);
per version the rollout's generation seconds and tokens/s, and its weight-load seconds (transfer, apply);
the weight path's GB/s on both sides against a raw copy of the same bytes (host to GPU from pinned memory on a
GPU, a memcpy on CPU).

``--size small`` (the default on CPU: hidden 128, 2 layers, vocab 4096, 32-token responses, 3 updates) runs the
same code in CI; its figures say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl.logs import metric_names as M  # noqa: E402
from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.rundir.fsio import read_jsonl  # noqa: E402
from hpcrl.logs.run_logs import read_metrics  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=256, vocab_size=4096),
}
"""Head dim 64 in both: vLLM's CPU attention refuses 32."""
DEFAULTS = {"0.5b": {"updates": 6, "tokens": 384}, "small": {"updates": 3, "tokens": 32}}


def build_model(folder: Path, shape: dict) -> Path:
    """The random-init model and its word-level tokenizer, saved as a bf16 HF folder (tmp -> rename)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from hpcrl.tiny.model import EOS, PAD, TINY_CHAT_TEMPLATE, UNK, quiet_progress_bars, tiny_vocab

    words = tiny_vocab() + [f"w{i}" for i in range(64, shape["vocab_size"])]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    with quiet_progress_bars():
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def raw_copy_gb_per_s(nbytes: int) -> float:
    """GB/s of one copy of ``nbytes`` into a preallocated buffer: pinned host -> GPU on a GPU, memcpy on CPU."""
    import torch

    cuda = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def parameters(path: Path) -> int:
    """Elements of every tensor of a safetensors file, from its header (nothing loaded)."""
    import math

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def median(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def summarise(rd: RunDir) -> dict:
    """Per-phase medians of the updates and versions after the first, and the weight path against a raw copy."""
    trainer = read_metrics(rd).to_dict("records")[1:]
    rollout = [r for r in read_jsonl(rd.rollout_metrics(RunDir.writer_name(0))) if r[M.PARAM_VERSION] >= 1]
    out = {"per_update_s": {name: median(trainer, key) for name, key in (
               ("wait_for_samples", M.WAIT_SAMPLES_S), ("update", M.UPDATE_S), ("publish", M.PARAM_SYNC_S),
               ("publish_gather", M.PARAM_SYNC_GATHER_S), ("publish_files", M.PARAM_SYNC_FILES_S),
               ("publish_broadcast", M.PARAM_SYNC_TRANSFER_S))},
           "per_version_rollout": {name: median(rollout, key) for name, key in (
               ("generation_s", M.WALL_S), ("tokens", M.TOKENS), ("tokens_per_s", M.TOKENS_PER_S),
               ("load_weights_s", M.LOAD_WEIGHTS_S), ("load_transfer_s", M.LOAD_TRANSFER_S),
               ("load_apply_s", M.LOAD_APPLY_S))},
           "trainer_tokens_per_s": median(trainer, M.TOKENS_PER_S),
           "weight_paths": sorted({r.get(M.WEIGHTS_PATH) for r in rollout} - {None})}
    nbytes = int(median(trainer, M.WEIGHTS_BYTES) or median(rollout, M.WEIGHTS_BYTES) or 0)
    if nbytes:
        raw = raw_copy_gb_per_s(nbytes)
        publish, load = out["per_update_s"]["publish"], out["per_version_rollout"]["load_weights_s"]
        out["weights"] = {"bytes": nbytes, "raw_copy_gb_per_s": round(raw, 2),
                          "publish_gb_per_s": round(nbytes / publish / 1e9, 3) if publish else None,
                          "load_gb_per_s": round(nbytes / load / 1e9, 3) if load else None}
        out["weights"]["raw_over_publish"] = round(raw / out["weights"]["publish_gb_per_s"], 1) if publish else None
        out["weights"]["raw_over_load"] = round(raw / out["weights"]["load_gb_per_s"], 1) if load else None
    return out


def main(argv: list[str]) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SHAPES), default="0.5b" if torch.cuda.is_available() else "small")
    p.add_argument("--updates", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="response length (max new tokens)")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of the GPU (the trainer has the rest)")
    a, extra = p.parse_known_args(argv)
    updates = a.updates or DEFAULTS[a.size]["updates"]
    tokens = a.tokens or DEFAULTS[a.size]["tokens"]
    a.run.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = build_model(a.run.parent / f"{a.run.name}-model", SHAPES[a.size])
    build_s = time.monotonic() - t0
    gpu = torch.cuda.is_available()
    overrides = [f"model.path={model}", "rollout.engine=vllm", "weights.transport=broadcast", "eval.every_versions=0",
                 f"rollout.response_length={tokens}", f"rollout.max_model_len={tokens + 64}",
                 "rollout.max_concurrent_groups=4", "actor.ppo_micro_batch_size=1", "actor.lr=1e-6",
                 "actor.zero_stage=2", f"rollout.total_rollout_steps={4 * updates}",
                 "timeouts.wait_samples_s=900", "timeouts.engine_start_s=900",
                 *([f"rollout.gpu_memory_utilization={a.vllm_memory}", "resources.trainer.gpus_per_node=1",
                    "resources.rollout.gpus_per_node=1"] if gpu else []), *extra]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny.yaml"), *overrides,
                           "--run-dir", str(a.run / "run"), "--executor", "local", "--timeout-min", "25"],
                          capture_output=True, text=True, cwd=REPO)
    figures: dict = {"size": a.size, "shape": SHAPES[a.size], "device": "cuda" if gpu else "cpu",
                     "updates": updates, "response_tokens": tokens, "vllm_memory": a.vllm_memory if gpu else None,
                     "build_model_s": round(build_s, 1), "run_wall_s": round(time.monotonic() - t0, 1),
                     "rc": proc.returncode, "overrides": overrides}
    if proc.returncode != 0:
        figures["output_tail"] = (proc.stdout + proc.stderr).splitlines()[-25:]
        a.out.write_text(json.dumps(figures, indent=1) + "\n")
        print("\n".join(figures["output_tail"]), file=sys.stderr)
        return 1
    rd = RunDir(a.run / "run")
    figures["parameters"] = parameters(model / "model.safetensors")
    figures.update(summarise(rd))
    found = audit(rd, rd.load_config().knobs.group_bound)
    figures.update(consumed_groups=found.consumed_groups, exactly_once_problems=found.problems())
    a.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures), file=sys.stderr)
    return 1 if found.problems() or found.consumed_groups != 4 * updates else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
