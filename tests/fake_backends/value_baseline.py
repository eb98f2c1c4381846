"""An advantage estimator on the critic's values: A_t = s_i - V_t on every kept step of trajectory i (the critic's
value as a per-token baseline of the score), returns s_i (the critic learns to predict the score). Its registry entry
declares that it needs values; nothing else in hpcrl names it."""
from __future__ import annotations

import torch

from hpcrl.trainer.advantages import AdvantageInputs


def estimate_score_minus_value(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    scores = x.scores[:, None].expand_as(x.steps)
    return (scores - x.values.float()) * x.steps, scores * x.steps
