"""The trainer's models: the trained policy (with a value head for GAE) and the frozen reference.

Why a value head on the policy, in the same DeepSpeed engine, rather than a
second engine with its own critic model: one engine means one optimizer, one
ZeRO partitioning, one checkpoint (written through the pickle-free
:class:`~hpcrl.trainer.safe_checkpoint.SafeCheckpointEngine`) and one
``latest.json`` commit point, so resume needs nothing new; and the critic costs
one linear layer instead of a second model. The price is a shared trunk: the
value loss (scaled by ``critic.vf_coef``) also trains the policy's layers, and
both share ``actor.lr`` and the global gradient-norm clip. A separate critic
model (verl's layout) would be a second engine plus a two-engine checkpoint.

The value head reads the last hidden state at the position whose logits
predict response token t, so V_t = V(prompt + response[:t]), the state in
which token t is chosen. It is zero-initialised (V = 0 at the start, where
GAE equals REINFORCE with a zero baseline).

The reference model is loaded from the same base model path, frozen
(``requires_grad`` off, eval mode) and kept outside DeepSpeed on the trainer's
device; it is only built when a KL term needs it.
"""
from __future__ import annotations

import torch
from torch import nn

POLICY_PREFIX = "policy."


class PolicyWithValueHead(nn.Module):
    """``forward`` returns the logits and (when there is a head) values at ``gather_pos`` only."""

    def __init__(self, policy: nn.Module, value_head: bool):
        super().__init__()
        self.policy = policy
        self.value_head = None
        if value_head:
            self.value_head = nn.Linear(policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gather_pos: torch.Tensor):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          output_hidden_states=self.value_head is not None)
        idx = gather_pos.unsqueeze(-1)
        logits = out.logits.gather(1, idx.expand(-1, -1, out.logits.shape[-1]))
        values = None
        if self.value_head is not None:
            hidden = out.hidden_states[-1]
            hidden = hidden.gather(1, idx.expand(-1, -1, hidden.shape[-1]))
            values = self.value_head(hidden).squeeze(-1).float()
        return logits, values


def policy_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The policy's tensors under the HF model's own names (what is published to rollout jobs)."""
    return {k[len(POLICY_PREFIX):]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}


def load_reference(path, device: str = "cpu") -> nn.Module:
    """A frozen copy of the base model: the reference policy of the KL terms."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ref.requires_grad_(False)
    return ref
