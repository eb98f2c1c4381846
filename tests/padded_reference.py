"""The trainer's model pass as it was before token budgets, packing and chunked log-probs (hpcrl before
2026-12-06): every row right-padded to the longest of the rows given, the model's whole ``[B, T, V]`` logits
materialised, gathered at the positions that predict response tokens, then ``log_softmax(logits / T)`` in float32.
The tests' oracle for the new layouts (tests/test_trainer_layout.py, tests/layout_peer.py), and the "before"
of bench/bench_trainer_memory.py. Same signature as :func:`hpcrl.trainer.forward.run_model`.
"""
from __future__ import annotations

import contextlib

import torch

from hpcrl.trainer.batch import Batch
from hpcrl.trainer.lora import AdapterOff, peft_model
from hpcrl.trainer.token_baseline import score_norm_sq


def padded_inputs(batch: Batch, pad_id: int):
    """([B, T] ids, [B, T] attention mask, [B, L] positions whose logits predict response token t)."""
    B = len(batch)
    T = int(batch.seq_lens.max())
    L = batch.targets.shape[1]
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    gather_pos = torch.zeros((B, L), dtype=torch.long)
    for b in range(B):
        seq = batch.sequence(b)
        P, R = int(batch.prompt_lens[b]), int(batch.resp_lens[b])
        ids[b, :len(seq)] = seq
        attention[b, :len(seq)] = 1
        gather_pos[b, :R] = torch.arange(P - 1, P - 1 + R)
    return ids, attention, gather_pos


def padded_run_model(module, micro: Batch, temperature: float, layout, device, extra=None, extra_grad=False):
    """``(logp, extra, values)`` [b, L] by the padded whole-logits path (module docstring)."""
    adapter_off = isinstance(module, AdapterOff)
    inner = getattr(module, "_module", None) if adapter_off else getattr(module, "module", module)
    off = peft_model(inner).disable_adapter() if adapter_off else contextlib.nullcontext()
    ids, attention, gather_pos = (t.to(device) for t in padded_inputs(micro, layout.pad_id))
    with off:
        out = inner.policy(input_ids=ids, attention_mask=attention,
                           output_hidden_states=inner.value_head is not None and not adapter_off)
    full = out.logits
    logits = full.gather(1, gather_pos.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = micro.targets.to(device)
    picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    more = None
    if extra == "entropy":
        more = -(logp_all.exp() * logp_all).sum(-1)
        more = more if extra_grad else more.detach()
    elif extra == "score_norm":
        more = score_norm_sq(logp_all, targets).detach()
    values = None
    if inner.value_head is not None and not adapter_off:
        hidden = out.hidden_states[-1]
        hidden = hidden.gather(1, gather_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        values = inner.value_head(hidden).squeeze(-1).float()
    valid = (torch.arange(micro.targets.shape[1])[None, :] < micro.resp_lens[:, None]).to(device)
    zero = lambda t: None if t is None else torch.where(valid, t, torch.zeros_like(t))  # noqa: E731
    return zero(picked), zero(more), zero(values)
