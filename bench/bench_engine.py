"""Benchmark of the rollout engines on the same prompts and lengths, as ratios in one run.

Three engines generate ``--prompts`` prompts x ``--n`` responses of at most ``--tokens``
tokens (EOS stops a response; every engine counts the tokens it really generated) from one
randomly initialised Qwen2 model (head dim 64, so vLLM's CPU build serves it):

- ``transformers``: hpcrl's :class:`TransformersEngine` through the rollout job's runner, all
  groups in flight at once (one thread each, as ``rollout.max_concurrent_groups`` does);
- ``vllm (ours)``: hpcrl's :class:`VLLMEngine` through the same runner: each response one
  request, all groups in flight at once;
- ``vllm (bare)``: vLLM's ``AsyncLLM`` as a user would drive it: one request per prompt with
  ``n`` responses, all in flight at once, same sampling parameters (processed log-probs
  returned too, as ours asks).

Each engine first runs the whole batch once untimed (warm-up), then ``--repeats`` timed runs;
the table reports median tokens/s and ``ours / bare`` (target >= 0.95 on a GPU) and
``vllm / transformers``. On CPU the numbers say little about a GPU; run it on a GPU node with
``--device cuda --dtype bfloat16 --hidden 1024 --layers 16`` for figures that matter.

Run::

    .venv/bin/python bench/bench_engine.py --quick
    .venv/bin/python bench/bench_engine.py --prompts 64 --n 8 --tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 128, 1),
                      max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                      bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def prompts_of(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (8 + i % 8,), generator=g).tolist() for i in range(count)]


def run_ours(name: str, opts, vopts, prompts, n: int, repeats: int) -> list[float]:
    """tokens/s of hpcrl's engine ``name`` over ``repeats`` timed runs (after one warm-up)."""
    from hpcrl.config import RunConfig
    from hpcrl.rollout.engine import EngineRunner
    from hpcrl.rollout.engines import make_engine

    runner = EngineRunner()
    cfg = RunConfig()
    cfg.rollout.max_model_len, cfg.rollout.max_num_seqs = vopts.max_model_len, vopts.max_num_seqs
    engine = make_engine(name, opts, cfg, runner, timeout_s=900)

    async def batch():
        groups = await asyncio.gather(*(engine.generate(p, n, seed=i) for i, p in enumerate(prompts)))
        return sum(len(s.response_ids) for g in groups for s in g)

    rates = []
    try:
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            tokens = runner.call(batch, 3600, f"{name} batch")
            if rep:
                rates.append(tokens / (time.perf_counter() - t0))
    finally:
        engine.close()
        runner.close()
    return rates


def run_bare(opts, vopts, prompts, n: int, repeats: int) -> list[float]:
    """tokens/s of vLLM's AsyncLLM driven directly (one request of n per prompt)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from hpcrl.rollout.vllm_engine import engine_core_environment, memory_args
    from hpcrl.rollout.vllm_sockets import use_own_socket_folder

    engine_core_environment(opts, vopts)  # the same processes as our engine: the ratio compares the driving, not them
    use_own_socket_folder()  # and no socket files left in /tmp

    async def main():
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(opts.model_dir), skip_tokenizer_init=True, dtype=opts.dtype,
            max_model_len=vopts.max_model_len, **memory_args(opts, vopts), enforce_eager=vopts.enforce_eager,
            max_num_seqs=vopts.max_num_seqs, logprobs_mode="processed_logprobs", seed=0))

        async def one(i, p):
            sp = SamplingParams(n=n, temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_new_tokens,
                                logprobs=0, seed=i if opts.device == "cuda" else None, detokenize=False, stop_token_ids=[1],
                                output_kind=RequestOutputKind.FINAL_ONLY)
            last = None
            async for out in llm.generate({"prompt_token_ids": p}, sp, request_id=f"bare-{i}-{time.time_ns()}"):
                last = out
            return sum(len(c.token_ids) for c in last.outputs)

        rates = []
        try:
            for rep in range(repeats + 1):
                t0 = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
                if rep:
                    rates.append(tokens / (time.perf_counter() - t0))
        finally:
            llm.shutdown()
        return rates

    return asyncio.run(main())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true", help="(slow on big models)")
    p.add_argument("--quick", action="store_true", help="8 prompts x 4, 32 tokens, 1 repeat")
    p.add_argument("--json", default=None, help="also write the medians and ratios to this file (bench/gpu_check.sh)")
    a = p.parse_args(argv)
    if a.device == "cuda":  # vLLM forks its engine core: a fork after this process touched CUDA dies
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if a.quick:
        a.prompts, a.n, a.tokens, a.repeats = 8, 4, 32, 1
    from hpcrl.rollout.engine import EngineOptions
    from hpcrl.rollout.vllm_engine import VLLMOptions

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", a.hidden, a.layers, a.vocab)
        opts = EngineOptions(model, max_new_tokens=a.tokens, temperature=1.0, top_p=1.0, device=a.device,
                             dtype=a.dtype)
        vopts = VLLMOptions(max_model_len=a.tokens + 32, max_num_seqs=256)
        prompts = prompts_of(a.prompts, a.vocab)
        rates = {}
        if not a.skip_transformers:
            rates["transformers"] = run_ours("transformers", opts, vopts, prompts, a.n, a.repeats)
        rates["vllm (ours)"] = run_ours("vllm", opts, vopts, prompts, a.n, a.repeats)
        rates["vllm (bare)"] = run_bare(opts, vopts, prompts, a.n, a.repeats)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{a.prompts} prompts x n={a.n}, <= {a.tokens} tokens, Qwen2 hidden {a.hidden} x {a.layers} layers, "
          f"{a.device} {a.dtype}, median of {a.repeats}")
    print(f"{'engine':<16}{'tokens/s':>12}   runs")
    for k, v in rates.items():
        print(f"{k:<16}{med[k]:>12.0f}   {', '.join(f'{x:.0f}' for x in v)}")
    print(f"ours / bare vLLM: {med['vllm (ours)'] / med['vllm (bare)']:.3f}")
    if "transformers" in med:
        print(f"vllm (ours) / transformers: {med['vllm (ours)'] / med['transformers']:.2f}")
    if a.json:
        figures = {"device": a.device, "dtype": a.dtype, "prompts": a.prompts, "n": a.n, "max_tokens": a.tokens,
                   "tokens_per_s": med, "ours_over_bare_vllm": med["vllm (ours)"] / med["vllm (bare)"]}
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
