"""The names a config may choose from, defined once, here at the bottom layer.

The config checks a value against these tables before anything is submitted; the
implementations (``hpcrl/trainer/``, ``hpcrl/rollout/``, ``hpcrl/weights/``) look
their functions up by the same names, and ``tests/test_layers.py`` asserts that
every name here has an implementation and every implementation a name.
"""
from __future__ import annotations

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo_passk",
                  "gpg", "remax", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo", "grpo_vectorized",
                  "rloo_vectorized")
"""``algorithm.adv_estimator`` (hpcrl/trainer/advantages.py); ``*_vectorized`` are verl's other
implementations of grpo and rloo, accepted as their aliases."""

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg",
                    "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo", "grpo_vectorized",
                    "rloo_vectorized")
"""The estimators whose baseline is the rest of the group: they need ``rollout.n >= 2``."""

POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "sapo",
                     "dro")
"""``actor.policy_loss.loss_mode`` (hpcrl/trainer/policy_losses.py)."""

KL_ESTIMATORS = ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs",
                 "kl+", "k1+", "mse+", "k2+", "low_var_kl+", "k3+", "abs+")
"""``actor.kl_loss_type`` and ``algorithm.kl_penalty`` (hpcrl/trainer/kl.py); ``+``: verl 0.9.1's
straight-through forms (the base estimator's value, k2's gradient)."""

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""``actor.loss_agg_mode`` (hpcrl/trainer/losses.py)."""

IS_LEVELS = ("token", "sequence")
"""``algorithm.rollout_correction.rollout_is`` (hpcrl/trainer/offpolicy.py)."""

RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""``algorithm.rollout_correction.rollout_rs`` (hpcrl/trainer/offpolicy.py), verl 0.9.1's names; a
comma-separated list of them applies all (a token is kept only if every option keeps it)."""

PF_PPO_REWEIGHT_METHODS = ("pow", "max_min", "max_random")
"""``algorithm.pf_ppo.reweight_method`` (hpcrl/trainer/pf_ppo.py)."""

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""``algorithm.rollout_correction.loss_type``: the loss of verl 0.9.1's bypass mode (hpcrl/trainer/update.py)."""

RS_RETIRED = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""verl 0.6's ``rollout_rs`` levels, refused with the 0.9.1 option that replaces each (the README
translates the bounds: 0.9.1's k1 bounds apply to 1/rho)."""

REWARD_NAMES = ("toy_copy", "token_match", "exact_match", "last_number", "math_verify", "gsm8k", "toy_calc")
"""``reward.name``: the built-in rule-based rewards (hpcrl/rollout/rewards.py)."""

TRUNCATIONS = ("filter", "left", "right", "error")
"""``data.truncation``: what happens to a prompt longer than ``data.max_prompt_length``
(hpcrl/rollout/data.py)."""

LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")
"""``logging.backends`` (hpcrl/trackers.py); ``jsonl`` is always written."""

WANDB_MODES = ("offline", "online")
"""``logging.wandb_mode``."""

ENGINES = ("transformers", "vllm")
"""``rollout.engine`` (hpcrl/rollout/engine.py: one file per backend)."""

ROLLOUT_DEVICES = ("auto", "cpu", "cuda")
"""``rollout.device``: ``auto`` = cuda when the job sees a GPU, else cpu."""

DTYPES = ("float32", "bfloat16", "float16")
"""``rollout.dtype``: the engine's weights and activations."""

BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-h64")
"""``model.path`` values that build a tiny model at launch (hpcrl/tiny/model.py): ``tiny`` has
4 heads of 32, ``tiny-h64`` 2 heads of 64 (what vLLM's CPU attention needs), same parameters."""

WEIGHT_TRANSPORTS = ("auto", "broadcast", "filesystem")
"""``weights.transport`` (hpcrl/weights/registry.py): ``auto`` = broadcast where it forms, files otherwise."""

BROADCAST_BACKENDS = ("auto", "gloo", "nccl")
"""``weights.broadcast_backend`` (hpcrl/weights/group.py): ``auto`` = nccl when both ends hold CUDA tensors."""

RENAMED_KEYS = {
    "weights.bucket_mb": ("weights.bucket_mib", "the same number: it always counted MiB"),
    "agent.max_tool_response_length": ("agent.max_tool_response_chars", "the same number: it counts characters"),
}
"""Keys that were renamed (units in the name): the old key is refused with the new one and how to convert."""

KL_CTRL_TYPES = ("fixed", "adaptive")
"""``algorithm.kl_ctrl.type`` (hpcrl/trainer/kl.py)."""

AGENT_LOOPS = ("single_turn", "tool_agent")
"""``agent.default`` and a data row's ``agent_name`` (hpcrl/rollout/loops.py: one file per loop)."""

TOOL_PARSERS = ("hermes", "tiny")
"""``agent.tool_parser`` (hpcrl/rollout/tool_parsers.py)."""

BUILTIN_DATA = ("builtin:toy", "builtin:toy_calc", "builtin:toy_heldout")
"""``data.source`` and ``data.val_files`` values generated in hpcrl/rollout/dataset.py (``toy_heldout``: the toy
task in phrasings it never trains on, its held-out split)."""

VERL_KEYS = {
    "trainer.test_freq": "eval.every_versions",
    "trainer.val_before_train": "eval.before_training",
    "actor_rollout_ref.rollout.val_kwargs.n": "eval.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "eval.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "eval.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "eval.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "eval.top_k",
}
"""verl's dotted keys that mean an hpcrl key under another name: the config (YAML or ``key=value``) may use
either; the verl key is renamed before the config is built (``hpcrl/config/run.py``). ``data.val_files`` has
the same name in both."""
