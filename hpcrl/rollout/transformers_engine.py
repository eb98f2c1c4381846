"""The transformers engine: any local HF causal LM with hpcrl's own sampling loop.

It returns, for every sampled token, the log-prob under the distribution it was actually
sampled from (after temperature and top-p): the behaviour policy of importance sampling.
It runs on CPU (tests, laptops) or on a GPU (``rollout.device``, bf16 allowed) and is the
numerical reference for the other engines; vLLM is the GPU path. In a LoRA run (``actor.lora_rank``) it holds the
base model with peft's LoRA layers, and a weight version fills the adapter (``adapters.py``). Each group generates in
a worker thread of the runner's loop; :meth:`abort_all` is seen between two decoding steps.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np
import torch

from hpcrl.rollout.adapters import PeftAdapter, check_kind
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, EngineOptions, Sample
from hpcrl.weights.base import WeightVersion

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mask (to -inf) every token outside the ``top_k`` most likely ones (-1 or 0: none)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the smallest set with probability >= top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


class TransformersEngine(Engine):
    """Any local HF causal LM with hpcrl's own sampling loop; the numerical reference engine."""

    def __init__(self, opts: EngineOptions):
        from transformers import AutoModelForCausalLM

        self.device = opts.device
        self.model = AutoModelForCausalLM.from_pretrained(opts.model_dir, dtype=DTYPES[opts.dtype])
        self.model = self.model.to(self.device).eval()
        self.max_new_tokens = opts.max_new_tokens
        self.temperature = opts.temperature
        self.top_p = opts.top_p
        self.top_k = opts.top_k
        self.eos_id = self.model.config.eos_token_id
        if isinstance(self.eos_id, list):
            self.eos_id = self.eos_id[0]
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self._abort_epoch = 0  # bumped by abort_all; a generation started in an older epoch stops
        self.lora_rank = opts.lora_rank
        self.adapter = PeftAdapter(self.model) if opts.lora_rank else None
        """A LoRA run: peft's layers in ``model``, filled by each adapter version."""

    async def load_weights(self, version: WeightVersion) -> str:
        check_kind(version, self.lora_rank, "transformers")
        if self.adapter is not None:
            self.adapter.load(version)
            return "adapter"
        self.model.load_state_dict(version.tensors, strict=True)  # copies into the parameters (device, dtype)
        return "state_dict"

    @property
    def receive_device(self) -> str:
        return "cuda" if str(self.device).startswith("cuda") else "cpu"

    async def abort_all(self) -> None:
        self._abort_epoch += 1

    async def generate(self, prompt_ids: list[int], n: int, seed: int,
                       max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        return await asyncio.to_thread(self.generate_sync, prompt_ids, n, seed, max_new_tokens, greedy)

    @torch.inference_mode()
    def generate_sync(self, prompt_ids: list[int], n: int, seed: int,
                      max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        """:meth:`generate` in the calling thread (tests and benchmarks call it directly). Under inference mode, not
        only no_grad: no tensor of it outlives the call, and torch then skips the version counters and view
        tracking of every op (the same samples; on the tiny model ~10-15% less CPU per group)."""
        epoch = self._abort_epoch
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        finished = torch.zeros(n, dtype=torch.bool)
        tokens, logps, aborted = [], [], False
        for _ in range(max_new_tokens or self.max_new_tokens):
            logp, tok = self._sample(logits, gen, greedy)
            tokens.append(torch.where(finished, self.pad_id, tok))
            logps.append(logp.gather(1, tok[:, None]).squeeze(1))
            if self.eos_id is not None:
                finished |= tok == self.eos_id
            if bool(finished.all()):
                break
            if self._abort_epoch != epoch:
                aborted = True
                break
            out = self.model(input_ids=tok[:, None].to(self.device), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
        return self._samples(torch.stack(tokens, 1).numpy(), torch.stack(logps, 1).numpy(), aborted)

    def _sample(self, logits: torch.Tensor, gen: torch.Generator, greedy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs of the distribution sampled from, the sampled tokens) of one decoding step; temperature 0
        (or ``greedy``) is greedy (the log-probs then are the untempered ones)."""
        if greedy or self.temperature == 0:
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            return logp, logp.argmax(dim=-1)
        scaled = apply_top_p(apply_top_k(logits.float() / self.temperature, self.top_k), self.top_p)
        logp = torch.log_softmax(scaled, dim=-1).cpu()
        return logp, torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)

    def _samples(self, tok_mat: np.ndarray, lp_mat: np.ndarray, aborted: bool) -> list[Sample]:
        """Cut each row after its EOS; say why it ended."""
        samples = []
        for r in range(tok_mat.shape[0]):
            length, reason = tok_mat.shape[1], FINISH_ABORT if aborted else FINISH_LENGTH
            if self.eos_id is not None:
                hits = np.nonzero(tok_mat[r] == self.eos_id)[0]
                if len(hits):
                    length, reason = int(hits[0]) + 1, FINISH_STOP
            samples.append(Sample(tok_mat[r, :length].astype(np.int32), lp_mat[r, :length].astype(np.float32), reason))
        return samples
