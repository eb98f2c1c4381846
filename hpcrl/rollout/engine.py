"""Generation engines. The rollout loop needs only :class:`Engine`.

:class:`TransformersEngine` runs any local HF causal LM with its own sampling loop
(KV cache, temperature, top-p) so that it returns, for every sampled token, the
log-prob under the distribution it was actually sampled from (after temperature
and top-p): the behaviour policy of importance sampling. One engine is shared
by the rollout job's group threads; weights are swapped only while no group is
in flight (the loop drains first).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Sample:
    """One generated response."""

    response_ids: np.ndarray
    """Sampled tokens, up to and including EOS if one was sampled."""
    logprobs: np.ndarray
    """Log-prob of each sampled token under the sampling distribution."""


class Engine(abc.ABC):
    """What the rollout loop needs from a generation engine (one file per backend)."""

    @abc.abstractmethod
    def generate(self, prompt_ids: list[int], n: int, seed: int) -> list[Sample]:
        """``n`` independent responses to one prompt."""

    @abc.abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the model weights (no generation is running)."""


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

    def __init__(self, model_dir: Path | str, max_new_tokens: int, temperature: float, top_p: float,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.eos_id = self.model.config.eos_token_id
        if isinstance(self.eos_id, list):
            self.eos_id = self.eos_id[0]
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict, strict=True)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], n: int, seed: int) -> list[Sample]:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
        finished = torch.zeros(n, dtype=torch.bool)
        tokens, logps = [], []
        for _ in range(self.max_new_tokens):
            logp = torch.log_softmax(apply_top_p(logits.float() / self.temperature, self.top_p), dim=-1).cpu()
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            tokens.append(torch.where(finished, self.pad_id, tok))
            logps.append(logp.gather(1, tok[:, None]).squeeze(1))
            if self.eos_id is not None:
                finished |= tok == self.eos_id
            if bool(finished.all()):
                break
            out = self.model(input_ids=tok[:, None].to(self.device), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
        tok_mat = torch.stack(tokens, 1).numpy()
        lp_mat = torch.stack(logps, 1).numpy()
        samples = []
        for r in range(n):
            length = tok_mat.shape[1]
            if self.eos_id is not None:
                hits = np.nonzero(tok_mat[r] == self.eos_id)[0]
                if len(hits):
                    length = int(hits[0]) + 1
            samples.append(Sample(tok_mat[r, :length].astype(np.int32), lp_mat[r, :length].astype(np.float32)))
        return samples


ENGINES: dict[str, type] = {"transformers": TransformersEngine}
"""Engine class by ``rollout.engine`` (the allowed names: :data:`hpcrl.config.names.ENGINES`)."""


def make_engine(name: str, model_dir: Path | str, max_new_tokens: int, temperature: float, top_p: float) -> Engine:
    """The engine ``rollout.engine`` names, serving the model in ``model_dir``."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout.engine {name!r}; allowed: {', '.join(ENGINES)}")
    return ENGINES[name](model_dir, max_new_tokens, temperature, top_p)
