"""Turn groups read from shards into padded tensors for the policy loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.samples.schema import Group
from hpcrl.trainer.grpo import grpo_advantages, token_logprobs


@dataclass
class Batch:
    input_ids: torch.Tensor       # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T]
    gather_pos: torch.Tensor      # [B, L] position whose logits predict response token t
    targets: torch.Tensor         # [B, L] response tokens (pad where mask 0)
    mask: torch.Tensor            # [B, L] 1 = trained token
    logp_old: torch.Tensor        # [B, L] behaviour log-probs
    advantages: torch.Tensor      # [B, L] per-token advantage
    rewards: torch.Tensor         # [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, sl: slice) -> "Batch":
        return Batch(**{k: v[sl] for k, v in self.__dict__.items()})

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


def build_batch(groups: list[Group], pad_id: int, norm_adv_by_std: bool) -> Batch:
    trajs = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories])
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv = grpo_advantages(rewards, group_index, norm_adv_by_std)
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    resp_len = max(max(len(t.response_ids) for t in trajs), 1)
    B = len(trajs)
    input_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((B, seq_len), dtype=torch.long)
    gather_pos = torch.zeros((B, resp_len), dtype=torch.long)
    targets = torch.full((B, resp_len), pad_id, dtype=torch.long)
    mask = torch.zeros((B, resp_len), dtype=torch.float32)
    logp_old = torch.zeros((B, resp_len), dtype=torch.float32)
    for b, t in enumerate(trajs):
        P, L = len(t.prompt_ids), len(t.response_ids)
        input_ids[b, :P] = torch.from_numpy(t.prompt_ids.astype("int64"))
        input_ids[b, P:P + L] = torch.from_numpy(t.response_ids.astype("int64"))
        attention[b, :P + L] = 1
        gather_pos[b, :L] = torch.arange(P - 1, P - 1 + L)
        targets[b, :L] = torch.from_numpy(t.response_ids.astype("int64"))
        mask[b, :L] = torch.from_numpy(t.response_mask.astype("float32"))
        logp_old[b, :L] = torch.from_numpy(t.logprobs)
    return Batch(input_ids, attention, gather_pos, targets, mask, logp_old, adv[:, None].expand(B, resp_len).clone(),
                 rewards)


def policy_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """[B, L] log-probs of the response tokens under ``model``."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    picked = logits.gather(1, batch.gather_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return token_logprobs(picked, batch.targets, temperature)
