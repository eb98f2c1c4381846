"""DAPO's two options that verl keeps outside the actor's loss, with verl's keys and defaults.

DAPO (Yu et al. 2025) is four changes to GRPO. Two are actor options hpcrl already has (clip-higher:
``actor.clip_ratio_high``; the token-level loss: ``actor.loss_agg_mode=token-mean``); the other two are here:

- :class:`OverlongBufferConfig`, ``reward.overlong_buffer`` (verl: ``reward_model.overlong_buffer.*`` in
  recipe/dapo, ``reward_model.reward_kwargs.overlong_buffer_cfg.*`` in the fully_async scripts): the soft
  overlong punishment, added to the score by the rollout job (``hpcrl/rollout/shaping.py``);
- :class:`FilterGroupsConfig`, ``algorithm.filter_groups`` (verl's keys): dynamic sampling, done by the trainer
  when it takes groups (``hpcrl/trainer/dynamic_sampling.py``).

DAPO's fifth trick, overlong *filtering* (truncated responses masked out of the loss), has no verl key (verl's
docs/algo/dapo.md: "we don't implement it here"): it is ``actor.overlong_filter``. docs/algorithms.md has the
equations; configs/dapo.yaml verl's recipe settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpcrl.config.checks import check_choice, check_float, check_int, fail, reported

SEQ_METRICS = ("seq_reward", "seq_final_reward")
"""``filter_groups.metric`` values read from the trajectory's reward (verl: the sum of its token scores, the
overlong penalty included; ``seq_final_reward`` adds the KL penalty of ``use_kl_in_reward``)."""
OVERLONG_REWARD = "overlong_reward"
"""verl's name of the overlong penalty in a result's extra info (logged as ``reward_extra/overlong_reward``)."""
OVERLONG = "overlong"
"""verl's name of the flag ``overlong_reward < 0`` (logged as ``reward_extra/overlong``: the share in the buffer)."""
OVERLONG_METRICS = (OVERLONG_REWARD, OVERLONG)
"""The metrics the overlong buffer adds to every result when ``reward.overlong_buffer.log``."""
SCORE_METRICS = ("acc", "score")
"""``filter_groups.metric`` values of the reward function's own result, before the overlong penalty (verl's DAPO
reward manager: a number is recorded as ``acc``; a dict's keys as they are, ``score`` among them)."""


@dataclass
class OverlongBufferConfig:
    """``reward.overlong_buffer``: DAPO's soft overlong punishment. A response of L tokens whose limit is
    ``max_resp_len`` gets ``min(0, (max_resp_len - len - L) / len) * penalty_factor`` added to its score: 0 up to
    ``max_resp_len - len`` tokens, then falling linearly to ``-penalty_factor`` at the limit (verl's DAPO reward
    manager, where the penalty is added to the score before the reward goes to the trainer)."""

    enable: bool = False
    """Add the penalty (verl's default: off)."""
    len: int = 0
    """The buffer, in tokens: the penalty starts this many tokens before the limit (DAPO's recipe: 4096). At least
    1 and at most the limit when enabled."""
    penalty_factor: float = 0.0
    """The penalty at the limit (DAPO's recipe: 1.0); >= 0."""
    log: bool = True
    """Log the penalty as verl names it: ``reward_extra/overlong_reward`` (the mean penalty) and
    ``reward_extra/overlong`` (the share of responses inside the buffer) in each rollout job's per-version row;
    they are then also metrics ``algorithm.filter_groups.metric`` may name. (verl's default is false; the share of
    truncated responses, ``response_length/clip_ratio``, is logged either way.)"""
    max_resp_len: Optional[int] = None
    """The limit L is measured against (verl: ``reward_model.reward_kwargs.max_resp_len``; recipe/dapo passes
    ``data.max_response_length``); null: ``rollout.response_length``. A response counts every token of the
    trajectory, tool responses too, as the limit does."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        k = "reward.overlong_buffer."
        check_choice(k + "enable", self.enable, (True, False))
        check_choice(k + "log", self.log, (True, False))
        check_float(k + "penalty_factor", self.penalty_factor, 0.0)
        if self.max_resp_len is not None:
            check_int(k + "max_resp_len", self.max_resp_len, 1)
        if self.enable:
            check_int(k + "len", self.len, 1)
        else:
            check_int(k + "len", self.len, 0)


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups``: DAPO's dynamic sampling. A group whose ``metric`` has the same value for every
    trajectory (population std 0: all right, or all wrong) has zero advantage under a group-normalised estimator;
    the trainer drops it before it enters an update (consumed, never trained: counted like the other drops) and
    its place in the admission budget is given back, so every update still trains R groups that carry a
    gradient. A group of one trajectory is always kept, as in verl."""

    enable: bool = False
    """Drop groups whose ``metric`` has zero spread (verl's default: off)."""
    metric: Optional[str] = None
    """What must vary within a group: ``acc`` (DAPO's recipe) or ``score`` (the reward function's result before the
    overlong penalty; a number result is both), ``seq_reward`` (the trajectory's reward, penalty included),
    ``seq_final_reward`` (the same; refused together with ``use_kl_in_reward``, whose penalty is computed inside
    the update), or any other key of the dict your reward function returns (``overlong_reward``,
    ``overlong`` with ``reward.overlong_buffer.log``). Required with enable."""
    max_num_gen_batches: int = 0
    """The stop rule, verl's: if one update has taken this many batches of R groups (``train/num_gen_batches``)
    and still lacks R that vary, the trainer stops the run with one line naming the cause (the data or reward no
    longer yields groups that vary). 0 or less: no limit (verl's default: the trainer then waits for samples, and
    the run ends as any run whose rollouts stopped, after ``timeouts.wait_samples_s``)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        k = "algorithm.filter_groups."
        check_choice(k + "enable", self.enable, (True, False))
        check_int(k + "max_num_gen_batches", self.max_num_gen_batches, -2**31)
        if self.metric is not None and not (isinstance(self.metric, str) and self.metric.isidentifier()):
            fail(k + "metric", self.metric, f"null or a metric name: {', '.join(SCORE_METRICS + SEQ_METRICS)}, or a "
                 "key of the dict your reward function returns")
        elif self.enable and self.metric is None:
            fail(k + "metric", None, f"a metric with enable=true: {', '.join(SCORE_METRICS + SEQ_METRICS)}, or a key "
                 "of the dict your reward function returns", "DAPO's recipe filters on acc: "
                 "algorithm.filter_groups.metric=acc")

    @property
    def reads_reward(self) -> bool:
        """The metric is the trajectory's reward itself (no value of its own travels in the shards)."""
        return self.metric in SEQ_METRICS


def check_dapo_combination(cfg) -> None:
    """The rules between DAPO's options and the rest of ``cfg`` (a RunConfig): the buffer fits inside the limit,
    and ``seq_final_reward`` cannot include a KL penalty the trainer computes only inside the update."""
    ob, fg = cfg.reward.overlong_buffer, cfg.algorithm.filter_groups
    if ob.enable and not reported("reward.overlong_buffer.", "rollout.response_length"):
        limit = ob.max_resp_len if ob.max_resp_len is not None else cfg.rollout.response_length
        source = "reward.overlong_buffer.max_resp_len" if ob.max_resp_len is not None else "rollout.response_length"
        if ob.len > limit:
            fail("reward.overlong_buffer.len", ob.len, f"at most {source} = {limit} (the buffer lies inside the "
                 "limit; verl asserts the same)", f"lower the buffer or raise {source}")
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        fail("algorithm.filter_groups.metric", fg.metric, "acc, score or seq_reward with "
             "algorithm.use_kl_in_reward=true (its KL penalty is computed inside the update, after the groups "
             "are chosen)", "filter on seq_reward (the same value without the KL penalty)")


def check_filter_metric(cfg, offered: set[str]) -> None:
    """At launch, once the reward was called on a real row of each data source (``offered``: the metrics every
    result has, :class:`hpcrl.rollout.reward_fn.RewardProbe`): a ``filter_groups.metric`` no result offers would be
    missing from every trajectory, and no group would ever be dropped (reported before anything is submitted)."""
    fg, ob = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    if not fg.enable or fg.metric is None or fg.reads_reward or fg.metric in offered:
        return
    if fg.metric in OVERLONG_METRICS:
        if not (ob.enable and ob.log):
            fail("algorithm.filter_groups.metric", fg.metric, f"{fg.metric} only with reward.overlong_buffer.enable "
                 "and .log (the overlong penalty is that metric)", "turn the buffer and its log on, or filter on acc")
        return
    fail("algorithm.filter_groups.metric", fg.metric, f"a metric your reward's results offer: "
         f"{', '.join(sorted(offered | set(SEQ_METRICS))) or ', '.join(SEQ_METRICS)} (its result on the first row of "
         "each data source)", "name one of them (a number result offers acc and score), or return the metric in "
         "your reward's dict")
