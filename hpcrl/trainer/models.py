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

from hpcrl.trainer.logprobs import logit_transform, token_logprobs

POLICY_PREFIX = "policy."


class PolicyWithValueHead(nn.Module):
    """``forward`` runs the policy's decoder on one :class:`~hpcrl.trainer.forward.Pack` and returns, for the
    positions that predict response tokens only: the tempered log-probs of the sampled tokens (from the hidden
    states, a chunk of rows at a time: :mod:`hpcrl.trainer.logprobs`), the extra number per token asked for
    (entropy or score norm), and the values (with a value head). The whole logits never exist."""

    def __init__(self, policy: nn.Module, value_head: bool):
        super().__init__()
        self.policy = policy
        self.value_head = None
        if value_head:
            self.value_head = nn.Linear(policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self._transform = logit_transform(policy.config)

    def forward(self, pack, temperature: float, chunk_rows: int, extra=None, extra_grad: bool = False):
        hidden = self.policy.get_decoder()(input_ids=pack.input_ids, position_ids=pack.position_ids,
                                           attention_mask=pack.attention_mask, use_cache=False).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pack.picks)
        logp, more = token_logprobs(self.policy.get_output_embeddings(), picked, pack.targets, temperature,
                                    rows=chunk_rows, extra=extra, extra_grad=extra_grad, transform=self._transform)
        values = self.value_head(picked).squeeze(-1).float() if self.value_head is not None else None
        return logp, more, values


def policy_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The policy's tensors under the HF model's own names (what is published to rollout jobs)."""
    return {k[len(POLICY_PREFIX):]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}


def load_reference(path, device="cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A frozen copy of the base model in ``dtype`` (the trainer's training dtype): the reference policy of the
    KL terms (the trainer runs it inside a :class:`PolicyWithValueHead` without a head)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ref.requires_grad_(False)
    return ref
