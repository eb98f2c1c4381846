"""The trainer's memory and time on long responses with a real vocabulary: the padded whole-logits path (hpcrl
before 2026-12-06, kept as tests/padded_reference.py) against the token-budget, packed, chunked path.

One update of one group of 16 responses on a Qwen2.5-0.5B-shaped model (hidden 896, 14/2 heads, MLP 4864, vocabulary
151,936, tied embeddings; random init, built locally; ``--layers``, 2 by default for CPU time), through the trainer's
own DeepSpeed engine and ``PolicyUpdate`` (GRPO, token-mean), each case in a process of its own:

- ``old``: micro-batches of one group (16 rows) padded to the longest response, the whole ``[B, T, V]`` logits;
- ``new``: ``actor.use_dynamic_bsz`` with ``--budget`` tokens per micro-batch, packed rows, log-probs from the
  hidden states in 256 MiB chunks, ``actor.gradient_checkpointing`` (``--no-checkpointing`` to leave it off).

Per case: the process's peak resident memory during the update above what it held before it (the model, its
Adam's states exist already: a warm-up update ran first; DeepSpeed frees the gradients after each step, so they are
in it), CPU seconds of the update, and hpcrl's prediction of that memory (``hpcrl/plan/memory.py``: the gradients,
activations and log-prob chunks) with its error. Response
lengths: fixed 256 / 1,024 / 2,048, and lognormal (mean 266, sigma 1, capped at 2,048; seeded); prompts of 64
tokens. The old path is run only where its predicted peak fits ``--old-limit-gib``; above that the figure is its
prediction, marked as such (a fit through the old cases that ran, checked against the formula
12 B L V + 2 B T V bytes measured in 2026-12-01).

    .venv/bin/python bench/bench_trainer_memory.py                 # 2 layers, fp32: ~20-40 CPU minutes
    .venv/bin/python bench/bench_trainer_memory.py --quick         # fixed 256 and lognormal only
    .venv/bin/python bench/bench_trainer_memory.py --layers 24 --cases single8192 --old-limit-gib 0   # full depth
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, table  # noqa: E402

VOCAB, HIDDEN, MLP, HEADS, KV_HEADS = 151936, 896, 4864, 14, 2
PROMPT = 64
N = 16


def lengths_of(case: str, seed: int = 0) -> list[int]:
    """The response lengths of a case: ``fixed<L>`` (16 of L), ``single<L>`` (one response of L: the full-depth
    model's case) or ``lognormal`` (16, mean 266, sigma 1, capped at 2,048)."""
    if case.startswith("fixed"):
        return [int(case[5:])] * N
    if case.startswith("single"):
        return [int(case[6:])]
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=math.log(266) - 0.5, sigma=1.0, size=N)
    return [int(min(2048, max(1, round(x)))) for x in draws]


def build_model(folder: Path, layers: int) -> Path:
    """The 0.5B shape with ``layers`` layers (random init, bf16 on disk as Qwen2.5 ships), the tiny tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpcrl.tiny.model import build_tokenizer

    if (folder / "config.json").exists():
        return folder
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32768,
                         tie_word_embeddings=True, dtype="bfloat16")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def overrides(path: str, model: Path, budget: int, checkpointing: bool, bf16: bool, case: str) -> list[str]:
    longest = max(lengths_of(case))
    common = [f"model.path={model}", "rollout.n=16", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1",
              f"rollout.response_length={max(2048, longest)}", f"actor.bf16={str(bf16).lower()}", "actor.lr=1e-6",
              "eval.every_versions=0"]
    if case.startswith("single"):  # a group of one: GRPO would give it no advantage, REINFORCE++ whitens over tokens
        common.append("algorithm.adv_estimator=reinforce_plus_plus")
    if path == "old":
        return common + ["actor.use_dynamic_bsz=false", "actor.use_remove_padding=false"]
    return common + ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={budget}",
                     f"actor.gradient_checkpointing={str(checkpointing).lower()}"]


CASE = r'''
import gc, json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.environ["REPO"]); sys.path.insert(0, os.path.join(os.environ["REPO"], "tests"))
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from hpcrl.config import load_config
from hpcrl.launcher.prepare import prepare_run_dir
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.trainer import memory, update
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.parts import _deepspeed
path, run, lengths, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
cfg = load_config(os.path.join(os.environ["REPO"], "configs/tiny.yaml"), json.loads(sys.argv[5]))
rd = prepare_run_dir(cfg, run, resume=False)
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
if path == "old":
    from padded_reference import padded_run_model
    update.run_model = padded_run_model
engine, _, layout = _deepspeed(cfg, rd, 0, 1)
upd = update.PolicyUpdate(cfg, engine, layout)
vocab = engine.module.policy.config.vocab_size
def group(ls, seed):
    rng = np.random.default_rng(seed)
    p = rng.integers(3, vocab, size=prompt)
    return [Group("w000", 0, [Trajectory(p, rng.integers(3, vocab, size=n), np.ones(n, np.int8),
                                         -rng.random(n).astype(np.float32), np.zeros(n, np.int32), float(i % 3))
                              for i, n in enumerate(ls)], 0.0, 0.0)]
upd.run(build_batch(group([8] * len(lengths), 1), layout.pad_id, 0))  # grads and Adam states exist from here on
gc.collect()
before = memory.current_gib()
memory.reset_peaks()
t0, w0 = time.process_time(), time.monotonic()
stats = upd.run(build_batch(group(lengths, 2), layout.pad_id, 0))
cpu, wall = time.process_time() - t0, time.monotonic() - w0
print(json.dumps({"before_gib": before, "peak_gib": memory.host_peak_gib(), "cpu_s": cpu, "wall_s": wall,
                  "loss": stats["actor/pg_loss"]}))
'''


def run_case(root: Path, model: Path, path: str, case: str, budget: int, checkpointing: bool, bf16: bool) -> dict:
    ls = lengths_of(case)
    out = subprocess.run([sys.executable, "-c", CASE, path, str(root / f"run-{path}-{case}"), json.dumps(ls),
                          str(PROMPT), json.dumps(overrides(path, model, budget, checkpointing, bf16, case))],
                         capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "REPO": str(REPO), "DS_ACCELERATOR": "cpu",
                              "MASTER_PORT": str(_port())})
    if out.returncode:
        raise SystemExit(f"{path} {case} failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["above_gib"] = got["peak_gib"] - got["before_gib"]
    return got


def _port() -> int:
    from hpcrl.process.network import free_port

    return free_port()


def predicted_gib(path: str, case: str, layers: int, budget: int, checkpointing: bool, bf16: bool) -> float:
    """hpcrl's prediction of the update's working memory (activations, logits) for this case, GiB."""
    from hpcrl.plan.memory import ZERO0_GRADIENT_COPIES, ModelShape, update_working_bytes

    shape = ModelShape(vocab=VOCAB, hidden=HIDDEN, intermediate=MLP, layers=layers, heads=HEADS, kv_heads=KV_HEADS,
                       params=0, tied=True)
    ls = lengths_of(case)
    d = 2 if bf16 else 4
    # DeepSpeed sets .grad to None after each step: an update allocates them again (ZeRO 0, as plan/memory.py)
    grads = shape.total_params * 4 * ZERO0_GRADIENT_COPIES
    b = len(ls)
    if path == "old":
        return (grads + update_working_bytes(shape, tokens=b * (PROMPT + max(ls)), rows=b, response_tokens=b * max(ls),
                                             checkpointing=False, dtype_bytes=d, chunk_mib=None)) / 2**30
    # the largest micro-batch: the budget's worth of rows, or the longest row alone
    return (grads + update_working_bytes(shape, tokens=min(max(budget, PROMPT + max(ls)), b * PROMPT + sum(ls)),
                                         rows=b, response_tokens=min(max(budget - PROMPT, max(ls)), sum(ls)),
                                         checkpointing=checkpointing, dtype_bytes=d, chunk_mib=256.0)) / 2**30


def main() -> int:
    p = bench_parser(__doc__, "fixed 256 and lognormal only")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--budget", type=int, default=4096, help="new path: actor.ppo_max_token_len_per_gpu")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (default: fp32, the trainer's CPU default)")
    p.add_argument("--old-limit-gib", type=float, default=12.0, help="run the old path only below this prediction")
    p.add_argument("--cases", default=None, help="comma-separated: fixed256,fixed1024,fixed2048,lognormal")
    a = p.parse_args()
    cases = a.cases.split(",") if a.cases else (["fixed256", "lognormal"] if a.quick else
                                                ["fixed256", "fixed1024", "fixed2048", "lognormal"])
    ckpt = not a.no_checkpointing
    parent = Path(a.dir or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-trainer-memory-", dir=parent))
    model = build_model(parent / f"bench-trainer-memory-model-{a.layers}l", a.layers)  # kept: built once per size
    rows, results = [], {}
    for case in cases:
        ls = lengths_of(case)
        for path in ("old", "new"):
            pred = predicted_gib(path, case, a.layers, a.budget, ckpt, a.bf16)
            if path == "old" and pred > a.old_limit_gib:
                results[(path, case)] = None
                rows.append([case, path, f"{sum(ls)}", f"{len(ls) * max(ls)}", f"(not run) {pred:.1f}", "", f"{pred:.2f}", ""])
                continue
            got = run_case(root, model, path, case, a.budget, ckpt, a.bf16)
            results[(path, case)] = got
            err = (pred - got["above_gib"]) / got["above_gib"] if got["above_gib"] > 0 else math.nan
            rows.append([case, path, f"{sum(ls)}", f"{len(ls) * max(ls)}", f"{got['above_gib']:.2f}", f"{got['cpu_s']:.1f}",
                         f"{pred:.2f}", f"{err:+.0%}"])
            print(f"{case} {path}: above {got['above_gib']:.2f} GiB, {got['cpu_s']:.1f} CPU s, predicted "
                  f"{pred:.2f} GiB", flush=True)
    print(f"\n0.5B shape, {a.layers} layers, vocabulary {VOCAB}, {'bf16' if a.bf16 else 'fp32'}, 16 responses + "
          f"{PROMPT}-token prompts; new: {a.budget}-token micro-batches, packed, 256 MiB log-prob chunks, "
          f"{'checkpointed layers' if ckpt else 'no checkpointing'}")
    print(table(["case", "path", "response tokens", "padded positions", "peak above (GiB)", "CPU s",
                 "predicted (GiB)", "pred. error"], rows))
    for case in cases:
        old, new = results.get(("old", case)), results.get(("new", case))
        if old and new:
            print(f"{case}: old/new memory {old['above_gib'] / new['above_gib']:.1f}x, "
                  f"CPU {old['cpu_s'] / new['cpu_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
