"""Log-probs of the sampled tokens from the final hidden states, a chunk of rows at a time.

The output layer turns each hidden state into V logits (V = 151,936 for Qwen2.5), so a whole response's
logits are tokens x V: 2.3 MB per token in the float32 a log-softmax needs, 64 GB for 28K tokens. Here the
hidden states of the positions that predict response tokens ([M, H]) go through the output layer
``chunk_rows`` rows at a time; each chunk's logits become, in float32, ``log_softmax(logits / T)`` at the
sampled token and (when asked) one more number per token, and are dropped before the next chunk. With
gradients and more than one chunk each chunk is checkpointed: the backward pass recomputes the chunk's logits instead of keeping
them, so the forward and the backward both hold about three chunk-sized float32 blocks at most
(``actor.logprob_chunk_mib`` sets the block). The values are those of the whole-logits computation
(the same operations on the same rows).

The extra number per token (``extra``):

- ``"entropy"``: H_t = -sum_v p_v log p_v of the tempered distribution (with gradient when
  ``extra_grad``: the entropy bonus; otherwise a detached metric);
- ``"score_norm"``: w_t = 1 - 2 pi(y_t) + sum_v pi_v^2 (the optimal token baselines'
  :func:`hpcrl.trainer.token_baseline.score_norm_sq`), detached.

Models whose causal-LM forward does more than ``lm_head(hidden)`` to the logits say so in their config:
``final_logit_softcapping`` (Gemma 2), ``logit_scale`` (Cohere) and ``logits_scaling`` (Granite) are
applied here the same way (:func:`logit_transform`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from hpcrl.trainer.token_baseline import score_norm_sq

EXTRAS = ("entropy", "score_norm")


def chunk_rows(chunk_mib: float, vocab: int) -> int:
    """Rows per chunk so that one chunk's float32 logits take at most ``chunk_mib`` MiB (at least 1 row)."""
    return max(1, int(chunk_mib * 2**20) // (4 * vocab))


def logit_transform(config) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """What the model's causal-LM forward does to ``lm_head``'s output besides nothing (None: nothing)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    if not softcap and scale in (None, 1, 1.0) and divide in (None, 1, 1.0):
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale not in (None, 1, 1.0):
            logits = logits * scale
        if divide not in (None, 1, 1.0):
            logits = logits / divide
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return transform


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           extra: Optional[str], extra_grad: bool, transform) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (log-prob of each target, the extra number per row or an empty tensor)."""
    logits = head(hidden)
    if transform is not None:
        logits = transform(logits)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    del logits
    picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if extra is None:
        return picked, picked.new_zeros(0)
    if extra == "entropy":
        with torch.set_grad_enabled(extra_grad and torch.is_grad_enabled()):
            more = -(logp_all.exp() * logp_all).sum(-1)
    else:
        with torch.no_grad():
            more = score_norm_sq(logp_all, targets)
    return picked, more


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, *,
                   rows: int, extra: Optional[str] = None, extra_grad: bool = False, transform=None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(logp [M], extra [M] or None)`` of ``targets`` [M] given ``hidden`` [M, H] (module docstring), ``rows``
    rows of logits at a time; checkpointed per chunk when gradients flow."""
    assert extra in (None, *EXTRAS), extra
    # one chunk holds the whole: recomputing it in the backward would save nothing (its blocks are the peak either way)
    grad = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > rows
    picked, more = [], []
    for s in range(0, hidden.shape[0], rows):
        args = (head, hidden[s:s + rows], targets[s:s + rows], temperature, extra, extra_grad, transform)
        p, m = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        picked.append(p)
        more.append(m)
    if not picked:  # no response position here (a sequence-parallel rank's slice of prompt): the output layer is
        # still called, on nothing, as on the other ranks (under ZeRO-3 it gathers its weights with a collective)
        # (with a gradient where the other ranks' have one: the sequence-parallel gather's backward is a collective)
        empty = head(hidden[:0]).float().sum(-1)
        return empty, (None if extra is None else empty if extra == "entropy" and extra_grad else empty.detach())
    logp = torch.cat(picked)
    return logp, (torch.cat(more) if extra else None)
