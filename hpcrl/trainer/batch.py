"""A local update's groups as tensors: the token sequences back to back, the per-token fields padded.

Two layouts, for two costs:

- the **sequences** (prompt + response of every trajectory) are stored back to back in one flat tensor with
  offsets, never padded: they are what the model runs on, and what it costs is set by their real lengths
  (:mod:`hpcrl.trainer.forward` packs them per micro-batch);
- the **per-token fields** are ``[B, L]`` over response positions (B trajectories, L the longest response
  of the rows at hand): position t of row b is response token t. They hold a few numbers per token (no
  vocabulary or hidden dimension), so padding them costs little, and the math of the losses, advantages
  and corrections reads them as they are. :meth:`Batch.select` trims L to the rows it keeps, so a
  micro-batch of short rows is short.

Fields are filled in two stages: :func:`build_batch` (what the shards say) and
:meth:`hpcrl.trainer.update.PolicyUpdate.prepare` (what the trainer computes before its first optimizer
step: proximal / reference log-probs, values, advantages, importance weights, the loss mask).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch

from hpcrl.samples.schema import Group

Rows = Union[Sequence[int], torch.Tensor]


@dataclass
class Batch:
    """A local update's groups (module docstring): sequences back to back, per-token fields ``[B, L]``."""

    # ---- from the shards (build_batch)
    tokens: torch.Tensor          # [N] every row's prompt + response tokens, back to back (int64)
    offsets: torch.Tensor         # [B + 1] row b's tokens are tokens[offsets[b]:offsets[b + 1]]
    prompt_lens: torch.Tensor     # [B] tokens of row b's prompt (the response follows them)
    targets: torch.Tensor         # [B, L] response tokens (pad where the row is shorter)
    mask: torch.Tensor            # [B, L] response mask: 1 = model token, 0 = tool/env token or padding
    behav_logp: torch.Tensor      # [B, L] engine log-probs of the sampled tokens (behaviour policy mu)
    token_versions: torch.Tensor  # [B, L] weight version that sampled each token (padding: the trainer's)
    token_lag: torch.Tensor       # [B, L] trainer version at consumption - token version (>= 0)
    rewards: torch.Tensor         # [B] trajectory scores from the reward function
    group_index: torch.Tensor     # [B] which group (prompt) of this batch each trajectory belongs to
    # ---- computed by the trainer before the update (PolicyUpdate.prepare)
    logp_old: Optional[torch.Tensor] = None     # [B, L] PPO anchor: prox_logp if computed, else behav_logp
    prox_logp: Optional[torch.Tensor] = None    # [B, L] trainer log-probs at the start of the update
    ref_logp: Optional[torch.Tensor] = None     # [B, L] frozen reference model log-probs
    old_values: Optional[torch.Tensor] = None   # [B, L] critic values at the start of the update (gae)
    advantages: Optional[torch.Tensor] = None   # [B, L]
    returns: Optional[torch.Tensor] = None      # [B, L] critic targets (gae)
    is_weights: Optional[torch.Tensor] = None   # [B, L] truncated importance weights (None = 1)
    loss_mask: Optional[torch.Tensor] = None    # [B, L] mask times rejection / lag masks
    adv_mask: Optional[torch.Tensor] = None     # [B, L] tokens advantages and the critic see: loss_mask
                                                # with rollout_correction.mask_before_advantages, else mask
    w_token: Optional[torch.Tensor] = None      # [B, L] 1 - 2 pi(y_t) + sum_v pi_v^2 at the start of the
                                                # update (the optimal token baselines)
    reward_baselines: Optional[torch.Tensor] = None  # [B] remax: reward of a greedy response to the prompt
                                                # (the group's reward_baseline); None if a group has none

    def __len__(self) -> int:
        return self.prompt_lens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] tokens of each row (prompt + response): what a token budget counts."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def resp_lens(self) -> torch.Tensor:
        """[B] response tokens of each row (model and tool tokens)."""
        return self.seq_lens - self.prompt_lens

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    def sequence(self, b: int) -> torch.Tensor:
        """Row ``b``'s prompt + response tokens."""
        return self.tokens[int(self.offsets[b]):int(self.offsets[b + 1])]

    def to(self, device) -> "Batch":
        return Batch(**{f.name: (v.to(device) if (v := getattr(self, f.name)) is not None else None)
                        for f in fields(self)})

    def select(self, rows: Rows) -> "Batch":
        """The rows ``rows`` (any order, repeats allowed), per-token fields trimmed to their longest response."""
        idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        lens = self.seq_lens[idx]
        offsets = torch.zeros(len(idx) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lens, 0)
        tokens = torch.cat([self.sequence(int(b)) for b in idx]) if len(idx) else self.tokens[:0]
        width = max(int(self.resp_lens[idx].max()) if len(idx) else 0, 1)
        out = {"tokens": tokens, "offsets": offsets}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in out or v is None:
                continue
            v = v[idx.to(v.device)]
            out[f.name] = v[:, :width] if v.dim() == 2 else v
        return Batch(**out)

    def rows(self, sl: slice) -> "Batch":
        """Consecutive rows (a mini-batch)."""
        return self.select(range(len(self))[sl])


def build_batch(groups: list[Group], pad_id: int, trainer_version: int) -> Batch:
    """The groups' trajectories as a Batch; ``trainer_version`` is the version the lag is measured against."""
    trajs = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    resp_len = max(max(len(t.response_ids) for t in trajs), 1)
    B = len(trajs)
    seqs = [torch.from_numpy(t.prompt_ids.astype("int64")) for t in trajs]
    resps = [torch.from_numpy(t.response_ids.astype("int64")) for t in trajs]
    tokens = torch.cat([x for pair in zip(seqs, resps) for x in pair])
    lens = torch.tensor([len(p) + len(r) for p, r in zip(seqs, resps)], dtype=torch.long)
    offsets = torch.zeros(B + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    targets = torch.full((B, resp_len), pad_id, dtype=torch.long)
    mask = torch.zeros((B, resp_len), dtype=torch.float32)
    behav = torch.zeros((B, resp_len), dtype=torch.float32)
    versions = torch.full((B, resp_len), trainer_version, dtype=torch.long)
    for b, t in enumerate(trajs):
        L = len(t.response_ids)
        targets[b, :L] = resps[b]
        mask[b, :L] = torch.from_numpy(t.response_mask.astype("float32"))
        behav[b, :L] = torch.from_numpy(t.logprobs)
        versions[b, :L] = torch.from_numpy(t.token_versions.astype("int64"))
    baselines = None
    if all(g.reward_baseline is not None for g in groups):
        baselines = torch.tensor([g.reward_baseline for g in groups for _ in g.trajectories], dtype=torch.float32)
    prompt_lens = torch.tensor([len(p) for p in seqs], dtype=torch.long)
    return Batch(tokens, offsets, prompt_lens, targets, mask, behav, versions, trainer_version - versions,
                 rewards, group_index, reward_baselines=baselines)


def stand_in(like: Batch, pad_id: int) -> Batch:
    """A one-row batch of two pad tokens (one prompt, one response token) whose every mask is 0: the micro-batch
    a rank runs when it has no row left for a step the other ranks take (its loss is 0, its gradient zeros, and
    every collective of the forward and backward happens as on the other ranks)."""
    out = {"tokens": torch.full((2,), pad_id, dtype=torch.long), "offsets": torch.tensor([0, 2]),
           "prompt_lens": torch.tensor([1])}
    for f in fields(like):
        v = getattr(like, f.name)
        if f.name in out or v is None:
            continue
        shape = (1, 1) if v.dim() == 2 else (1,)
        out[f.name] = torch.full(shape, pad_id, dtype=v.dtype) if f.name == "targets" else torch.zeros(shape, dtype=v.dtype)
    return Batch(**out)
