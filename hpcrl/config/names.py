"""The names a config may choose from, defined once, here at the bottom layer.

Plain tables of names whose implementation dispatches on them (``hpcrl/trainer/``: ``tests/test_layers.py``
calls it with each), the names the registries are keyed by (:data:`SIMULATED_ENGINE`, :data:`SINGLE_TURN`,
:data:`BY_DATA_SOURCE`, ...) and renamed keys; verl's keys are :mod:`hpcrl.config.verl_keys`. The registries (name -> where the implementation
lives: engines, advantage estimators, agent loops, tool parsers, weight transports, rewards, policy losses) are
:mod:`hpcrl.config.registries`.
"""
from __future__ import annotations



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
"""verl 0.6's ``rollout_rs`` levels, refused with the 0.9.1 option that replaces each (docs/algorithms.md
translates the bounds: 0.9.1's k1 bounds apply to 1/rho)."""

BY_DATA_SOURCE = "by_data_source"
"""``reward.name`` that picks the rule from each row's ``data_source`` (verl's default_compute_score habit)."""

TRUNCATIONS = ("filter", "left", "right", "error")
"""``data.truncation``: what happens to a prompt longer than ``data.max_prompt_length``
(hpcrl/rollout/data.py)."""

LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")
"""``logging.backends`` (hpcrl/logs/trackers.py); ``jsonl`` is always written."""

WANDB_MODES = ("offline", "online")
"""``logging.wandb_mode``."""

SIMULATED_ENGINE = "simulated"
"""The engine that sleeps instead of generating (hpcrl/rollout/simulated_engine.py; section ``simulated``)."""

ROLLOUT_DEVICES = ("auto", "cpu", "cuda")
"""``rollout.device``: ``auto`` = cuda when the job sees a GPU, else cpu."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``rollout.dtype``: the engine's weights and activations (``auto``: bfloat16 on cuda, float32 on cpu)."""

BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-h64")
"""``model.path`` values that build a tiny model at launch (hpcrl/tiny/model.py): ``tiny`` has
4 heads of 32, ``tiny-h64`` 2 heads of 64 (what vLLM's CPU attention needs), same parameters."""

SHARE_BY_LOAD = "load"
"""``rollout.budget_share: load``: a version's budget is spread over the live fleet (hpcrl/config/knobs.py,
``may_start``)."""
FIRST_COME = "first_come"
"""``rollout.budget_share: first_come``: a job takes up to its bound whenever it asks (hpcrl's rule before the
share; kept to compare with)."""
BUDGET_SHARES = (SHARE_BY_LOAD, FIRST_COME)
"""``rollout.budget_share`` (hpcrl/config/knobs.py, ``may_start``)."""

BROADCAST_BACKENDS = ("auto", "gloo", "nccl")
"""``weights.broadcast_backend`` (hpcrl/weights/group.py): ``auto`` = nccl when both ends hold CUDA tensors."""

RENAMED_KEYS = {
    "weights.bucket_mb": ("weights.bucket_mib", "the same number: it always counted MiB"),
    "agent.max_tool_response_length": ("agent.max_tool_response_chars", "the same number: it counts characters"),
}
"""Keys that were renamed (units in the name): the old key is refused with the new one and how to convert."""

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
"""``actor.attn_implementation`` (transformers' names; ``auto``: hpcrl/trainer/parts.py picks)."""

KL_CTRL_TYPES = ("fixed", "adaptive")
"""``algorithm.kl_ctrl.type`` (hpcrl/trainer/kl.py)."""

SINGLE_TURN = "single_turn"
"""The single-turn agent loop's name (hpcrl/rollout/single_turn.py; a key of ``registries.AGENT_LOOPS``)."""
TOOL_AGENT = "tool_agent"
"""The tool agent's name (hpcrl/rollout/tool_agent.py; a key of ``registries.AGENT_LOOPS``)."""

BUILTIN_REWARD_MODELS = ("builtin:tiny-rm", "builtin:tiny-judge")
"""``reward_model.path`` values built into ``RUN/reward_model`` at launch (hpcrl/tiny/reward_model.py): ``tiny-rm`` a
tiny sequence classifier trained to predict the toy task's rule reward, ``tiny-judge`` a random tiny causal LM."""

REWARD_MODEL_KINDS = ("auto", "discriminative", "generative")
"""``reward_model.kind`` (hpcrl/reward/models.py)."""

REWARD_MODEL_PLACEMENTS = ("job", "rollout")
"""``reward_model.placement``: reward jobs of their own, or inside each rollout job."""

BUILTIN_DATA = ("builtin:toy", "builtin:toy_calc", "builtin:toy_heldout")
"""``data.source`` and ``data.val_files`` values generated in hpcrl/rollout/dataset.py (``toy_heldout``: the toy
task in phrasings it never trains on, its held-out split)."""
