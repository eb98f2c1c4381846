"""DAPO's reward side, in the rollout job: the overlong penalty and the value dynamic sampling filters on.

verl's DAPO reward manager (``verl/workers/reward_manager/dapo.py``, the agent loops' reward loop alike) calls the
reward function, records a number result as ``acc`` (a dict result's keys as they are, ``score`` among them), and
then adds the soft overlong punishment to the score: with a buffer of ``len`` tokens before the limit, a response of
L tokens gets

    overlong_reward = min(0, (max_resp_len - len - L) / len) * penalty_factor

(0 up to ``max_resp_len - len`` tokens, ``-penalty_factor`` at the limit), logged as ``overlong_reward`` and
``overlong`` (``overlong_reward < 0``). The shaped number is the trajectory's reward in the shard (verl's
``token_level_scores``: every estimator and ``filter_groups.metric=seq_reward`` see it); the metric ``acc`` or
``score`` is the function's own result, before the penalty. L counts every token of the trajectory's response, tool
responses too (as the limit, ``rollout.response_length``, does), for the single-turn and the tool agent alike.

When ``algorithm.filter_groups`` needs a value other than the reward, it travels with each trajectory
(``traj/filter_metric`` in the shard; the trainer decides, ``hpcrl/trainer/dynamic_sampling.py``); a trajectory
whose dict result lacks the key gets NaN there (one whose reward function failed scored 0, its ``acc`` too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.config.dapo import OVERLONG, OVERLONG_REWARD, SCORE_METRICS


def overlong_penalty(response_tokens: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment of a response of ``response_tokens`` (<= 0; module docstring)."""
    exceed = response_tokens - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


@dataclass
class Shaped:
    """One response's reward after shaping, and what goes with it."""

    reward: float
    """The score plus the overlong penalty (the score itself when the buffer is off)."""
    metric: Optional[float] = None
    """``filter_groups.metric``'s value when the run needs it in the shard (NaN: the result lacks it); else None."""
    logged: dict[str, float] = field(default_factory=dict)
    """``overlong_reward`` and ``overlong`` with ``reward.overlong_buffer.log`` (the per-version row's means)."""


class RewardShaping:
    """The run's DAPO reward options, applied to each scored response (module docstring)."""

    def __init__(self, cfg):
        """``cfg``: the RunConfig."""
        ob, fg = cfg.reward.overlong_buffer, cfg.algorithm.filter_groups
        self.buffer = ob if ob.enable else None
        self.max_resp_len = ob.max_resp_len if ob.max_resp_len is not None else cfg.rollout.response_length
        self.metric = fg.metric if fg.enable and not fg.reads_reward else None
        """The metric whose value must travel in the shard (None: the trainer reads the reward, or no filter)."""

    def shape(self, score: float, fields: dict[str, Any], response_tokens: int) -> Shaped:
        """The reward of a response of ``response_tokens`` tokens whose function returned ``score`` (and, for a dict
        result, ``fields``: its JSON scalars, as :meth:`RewardScorer.score_full` gives them; empty for a number)."""
        out = Shaped(score)
        extra = dict(fields) if fields else {"acc": score}  # verl: a number result is recorded as acc
        if self.buffer is not None:
            penalty = overlong_penalty(response_tokens, self.max_resp_len, self.buffer.len, self.buffer.penalty_factor)
            out.reward = score + penalty
            if self.buffer.log:
                out.logged = {OVERLONG_REWARD: penalty, OVERLONG: float(penalty < 0)}
                extra.update(out.logged)
        if self.metric is not None:
            out.metric = _number(score if self.metric in SCORE_METRICS and not fields else extra.get(self.metric))
        return out


def _number(value: Any) -> float:
    """A metric's value as a float (a bool is 0/1); NaN for anything else (missing, a string)."""
    if isinstance(value, (bool, int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return float("nan")
