"""The names a config may choose from, defined once, here at the bottom layer.

The config checks a value against these tables before anything is submitted; the
implementations (``hpcrl/trainer/``, ``hpcrl/rollout/``, ``hpcrl/weights/``) look
their functions up by the same names, and ``tests/test_layers.py`` asserts that
every name here has an implementation and every implementation a name.
"""
from __future__ import annotations

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""``algorithm.adv_estimator`` (hpcrl/trainer/advantages.py)."""

KL_ESTIMATORS = ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs")
"""``actor.kl_loss_type`` and ``algorithm.kl_penalty`` (hpcrl/trainer/kl.py)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""``actor.loss_agg_mode`` (hpcrl/trainer/losses.py)."""

IS_LEVELS = ("token", "sequence")
"""``algorithm.rollout_correction.rollout_is`` (hpcrl/trainer/offpolicy.py)."""

RS_LEVELS = ("token", "sequence", "geometric")
"""``algorithm.rollout_correction.rollout_rs`` (hpcrl/trainer/offpolicy.py)."""

REWARD_NAMES = ("toy_copy", "token_match", "exact_match", "last_number", "math_verify", "gsm8k")
"""``reward.name``: the built-in rule-based rewards (hpcrl/rollout/rewards.py)."""

TRUNCATIONS = ("filter", "left", "right", "error")
"""``data.truncation``: what happens to a prompt longer than ``data.max_prompt_length``
(hpcrl/rollout/data.py)."""

LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")
"""``logging.backends`` (hpcrl/trackers.py); ``jsonl`` is always written."""

WANDB_MODES = ("offline", "online")
"""``logging.wandb_mode``."""

ENGINES = ("transformers",)
"""``rollout.engine`` (hpcrl/rollout/)."""

WEIGHT_TRANSPORTS = ("filesystem",)
"""``weights.transport`` (hpcrl/weights/)."""

KL_CTRL_TYPES = ("fixed", "adaptive")
"""``algorithm.kl_ctrl.type`` (hpcrl/trainer/kl.py)."""
