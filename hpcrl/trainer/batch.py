"""Turn groups read from shards into padded tensors for the losses, and run the model on them.

Every per-token tensor is ``[B, L]`` over response positions (B trajectories,
L the longest response); position t of row b is response token t. Fields are
filled in two stages: :func:`build_batch` (what the shards say) and
:meth:`hpcrl.trainer.update.PolicyUpdate.prepare` (what the trainer computes
before its first optimizer step: proximal / reference log-probs, values,
advantages, importance weights, the loss mask).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hpcrl.samples.schema import Group
from hpcrl.trainer.losses import entropy_from_logp
from hpcrl.trainer.token_baseline import score_norm_sq


@dataclass
class Batch:
    # ---- from the shards (build_batch)
    """A local update's groups as padded tensors (prompt + response), with masks, versions and lags."""

    input_ids: torch.Tensor       # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    gather_pos: torch.Tensor      # [B, L] position whose logits predict response token t
    targets: torch.Tensor         # [B, L] response tokens (pad where mask 0)
    mask: torch.Tensor            # [B, L] response mask: 1 = model token, 0 = tool/env token or padding
    behav_logp: torch.Tensor      # [B, L] engine log-probs of the sampled tokens (behaviour policy mu)
    token_versions: torch.Tensor  # [B, L] weight version that sampled each token (padding: the trainer's)
    token_lag: torch.Tensor       # [B, L] trainer version at consumption - token version (>= 0)
    rewards: torch.Tensor         # [B] trajectory scores from the reward function
    group_index: torch.Tensor     # [B] which group (prompt) of this batch each trajectory belongs to
    truncated: Optional[torch.Tensor] = None  # [B] 1 = the response hit rollout.response_length
                                              # (traj/truncated; None if a trajectory has none)
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
        return self.input_ids.shape[0]

    def to(self, device) -> "Batch":
        return Batch(**{k: (v.to(device) if v is not None else None) for k, v in self.__dict__.items()})

    def slice(self, sl: slice) -> "Batch":
        return Batch(**{k: (v[sl] if v is not None else None) for k, v in self.__dict__.items()})

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


def build_batch(groups: list[Group], pad_id: int, trainer_version: int) -> Batch:
    """Pad the groups' trajectories; ``trainer_version`` is the version the lag is measured against."""
    trajs = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    resp_len = max(max(len(t.response_ids) for t in trajs), 1)
    B = len(trajs)
    input_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((B, seq_len), dtype=torch.long)
    gather_pos = torch.zeros((B, resp_len), dtype=torch.long)
    targets = torch.full((B, resp_len), pad_id, dtype=torch.long)
    mask = torch.zeros((B, resp_len), dtype=torch.float32)
    behav = torch.zeros((B, resp_len), dtype=torch.float32)
    versions = torch.full((B, resp_len), trainer_version, dtype=torch.long)
    for b, t in enumerate(trajs):
        P, L = len(t.prompt_ids), len(t.response_ids)
        input_ids[b, :P] = torch.from_numpy(t.prompt_ids.astype("int64"))
        input_ids[b, P:P + L] = torch.from_numpy(t.response_ids.astype("int64"))
        attention[b, :P + L] = 1
        gather_pos[b, :L] = torch.arange(P - 1, P - 1 + L)
        targets[b, :L] = torch.from_numpy(t.response_ids.astype("int64"))
        mask[b, :L] = torch.from_numpy(t.response_mask.astype("float32"))
        behav[b, :L] = torch.from_numpy(t.logprobs)
        versions[b, :L] = torch.from_numpy(t.token_versions.astype("int64"))
    baselines = None
    if all(g.reward_baseline is not None for g in groups):
        baselines = torch.tensor([g.reward_baseline for g in groups for _ in g.trajectories], dtype=torch.float32)
    truncated = None
    if all(t.truncated is not None for t in trajs):
        truncated = torch.tensor([float(t.truncated) for t in trajs], dtype=torch.float32)
    return Batch(input_ids, attention, gather_pos, targets, mask, behav, versions, trainer_version - versions,
                 rewards, group_index, truncated=truncated, reward_baselines=baselines)


def _tempered_logp(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[B, L, V] log_softmax(logits / temperature) at the positions choosing each response token, and values."""
    from hpcrl.trainer.models import PolicyWithValueHead

    inner = getattr(model, "module", model)
    if isinstance(inner, PolicyWithValueHead):
        logits, values = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               gather_pos=batch.gather_pos)
    else:
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = full.gather(1, batch.gather_pos.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
        values = None
    return torch.log_softmax(logits.float() / temperature, dim=-1), values


def forward(model, batch: Batch, temperature: float, entropy: bool = False, score_norm: bool = False
            ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(logp, entropy, values)`` of the response tokens, each [B, L] (entropy and values may be None);
    with ``score_norm`` the second is w_t = 1 - 2 pi(y_t) + sum_v pi_v^2 instead of the entropy.

    ``model`` is a :class:`hpcrl.trainer.models.PolicyWithValueHead` (or the DeepSpeed
    engine wrapping one), or a plain HF causal LM (the reference model).
    """
    logp, values = _tempered_logp(model, batch, temperature)
    picked = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    if score_norm:
        return picked, score_norm_sq(logp, batch.targets), values
    return picked, (entropy_from_logp(logp) if entropy else None), values
