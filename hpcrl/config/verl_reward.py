"""verl's reward-model keys as hpcrl reads them: a part of :data:`hpcrl.config.verl_keys.VERL_KEYS`.

verl 0.9.1 has them twice: the older top-level ``reward_model.*`` (``enable``, ``model.path``, the micro-batch and
max-length keys, ``reward_manager`` and the reward-loop keys, ``rollout.*`` of a judge's engine), which its
``migrate_legacy_reward_impl`` moves under ``reward.*``, and 0.9.1's own ``reward.reward_model.*`` (``enable``,
``model_path``, ``enable_resource_pool``, ``n_gpus_per_node``, ``nnodes``, ``rollout.*``) and
``reward.reward_manager.*``. The keys hpcrl's ``reward_model`` section also has (``enable``, ``max_length``,
``micro_batch_size``) are read as they are; the others are below, each read into an hpcrl key, noted as meaning
nothing here, or refused with the reason (hpcrl/config/reward_model.py, docs/reward-models.md).
"""
from __future__ import annotations

from hpcrl.config.verl_key import VerlKey

_RM_TOKENIZER = ("the policy's tokenizer is model.path's; a reward model whose tokenizer differs gets the prompt and the "
                 "decoded response through its own chat template (hpcrl/reward/inputs.py)")
_RM_FORWARD = ("a discriminative reward model runs a transformers forward, a judge reward_model.engine, in the reward job "
               "(reward_model.placement)")
_RM_STREAM = "each group is scored as it finishes, off the generation path (reward_model.scoring_groups)"
_RM_WORKERS = ("rule rewards run in the rollout job's group threads; a reward job batches the model's requests itself "
               "(reward_model.micro_batch_size)")
_RM_MANAGER = ("a reward-loop class of your own does not run here: write a reward.path function (it may take rm_score, "
               "the model's score, and reward_model, a client: docs/reward-models.md)")
_RM_ENGINE = "a vLLM option of the judge hpcrl does not set (the reward_model.* fields list the ones it does)"
_RM_ROLLOUT = {
    "dtype": "reward_model.dtype",
    "gpu_memory_utilization": "reward_model.gpu_memory_utilization",
    "tensor_model_parallel_size": "reward_model.tensor_parallel_size",
    "max_num_seqs": "reward_model.max_num_seqs",
    "prompt_length": VerlKey("reward_model.max_length", "the longest input of the reward model"),
    "response_length": VerlKey("reward_model.max_new_tokens", "the judge's longest verdict"),
    "temperature": "reward_model.temperature",
    "top_p": "reward_model.top_p",
    "seed": "reward_model.seed",
}
"""verl's ``reward_model.rollout.*`` keys (the judge's engine) hpcrl reads, by their name under the prefix."""

_LEGACY = ("enable", "enable_resource_pool", "n_gpus_per_node", "nnodes", "strategy", "model", "micro_batch_size",
           "micro_batch_size_per_gpu", "max_length", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
           "reward_manager", "reward_loop_source", "reward_loop_module_path", "reward_loop_class_name",
           "launch_reward_fn_async", "use_reward_loop", "num_workers", "rollout", "sandbox_fusion", "profiler",
           "ulysses_sequence_parallel_size", "reward_kwargs", "overlong_buffer")
"""verl's keys under its top-level ``reward_model`` (0.6-0.9.1): another one is refused as unknown, with the nearest."""

REWARD_MODEL_KEYS: dict[str, str | VerlKey] = {
    "reward.reward_model.enable": "reward_model.enable",
    "reward_model.model.path": "reward_model.path",
    "reward.reward_model.model_path": "reward_model.path",
    "reward_model.model.trust_remote_code": "reward_model.trust_remote_code",
    "reward_model.model.input_tokenizer": VerlKey(None, _RM_TOKENIZER),
    "reward_model.model.external_lib": VerlKey(None, "the reward model is a local HF folder loaded by transformers' "
                                               "own classes (reward_model.trust_remote_code for code in the folder)",
                                               refuse=True),
    "reward_model.model.*": VerlKey(None, _RM_FORWARD),
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size",
    "reward_model.forward_max_token_len_per_gpu": "reward_model.max_batch_tokens",
    "reward_model.use_dynamic_bsz": VerlKey(None, "a forward takes at most reward_model.micro_batch_size sequences and "
                                            "reward_model.max_batch_tokens padded tokens"),
    "reward_model.strategy": VerlKey(None, _RM_FORWARD),
    "reward_model.ulysses_sequence_parallel_size": VerlKey(None, "the reward model has no sequence parallelism "
                                                           "(one forward per micro-batch in one job)"),
    "reward_model.launch_reward_fn_async": VerlKey(None, _RM_STREAM),
    "reward_model.use_reward_loop": VerlKey(None, _RM_STREAM),
    "reward_model.num_workers": VerlKey(None, _RM_WORKERS),
    "reward_model.enable_resource_pool": VerlKey("reward_model.placement", "true: reward jobs of their own "
                                                 "(resources.reward_jobs); false: the model in each rollout job"),
    "reward.reward_model.enable_resource_pool": VerlKey("reward_model.placement", "true: reward jobs of their own "
                                                        "(resources.reward_jobs); false: the model in each rollout job"),
    "reward_model.n_gpus_per_node": "resources.reward.gpus_per_node",
    "reward.reward_model.n_gpus_per_node": "resources.reward.gpus_per_node",
    "reward_model.nnodes": VerlKey("resources.reward_jobs", "one reward job per node"),
    "reward.reward_model.nnodes": VerlKey("resources.reward_jobs", "one reward job per node"),
    "reward_model.reward_loop_source": VerlKey(None, _RM_MANAGER),
    "reward_model.reward_loop_class_name": VerlKey(None, _RM_MANAGER),
    "reward_model.reward_loop_module_path": VerlKey(None, _RM_MANAGER, refuse=True),
    "reward.reward_manager.source": VerlKey(None, _RM_MANAGER),
    "reward.reward_manager.module.path": VerlKey(None, _RM_MANAGER, refuse=True),
    "reward.reward_manager.module.*": VerlKey(None, _RM_MANAGER),
    "reward_model.rollout.name": VerlKey("reward_model.engine", "the generative judge's engine"),
    "reward.reward_model.rollout.name": VerlKey("reward_model.engine", "the generative judge's engine"),
    **{f"{prefix}.rollout.{verl}": target for prefix in ("reward_model", "reward.reward_model")
       for verl, target in _RM_ROLLOUT.items()},
    "reward_model.rollout.quantization": VerlKey(None, "the reward model runs in reward_model.dtype", refuse=True),
    "reward.reward_model.rollout.quantization": VerlKey(None, "the reward model runs in reward_model.dtype",
                                                        refuse=True),
    "reward_model.rollout.*": VerlKey(None, _RM_ENGINE),
    "reward.reward_model.rollout.*": VerlKey(None, _RM_ENGINE),
    "reward_model.sandbox_fusion.*": VerlKey(None, "code runs in the python tool's sandbox (agent.tools)"),
    "reward_model.profiler.*": VerlKey(None, "no profiler hooks: bench/ measures the exchanges, logs/*.jsonl time "
                                       "every step"),
    "reward_model.reward_kwargs.*": VerlKey(None, "arguments of verl's reward managers; your function's are "
                                            "reward.kwargs"),
    "reward_model.*": VerlKey(None, "a key of verl's reward model hpcrl does not know", keys=_LEGACY),
    "reward.reward_model.*": VerlKey(None, "a key of verl's reward model hpcrl does not know",
                                     keys=("enable", "enable_resource_pool", "n_gpus_per_node", "nnodes", "model_path",
                                           "rollout")),
}
"""The reward model's entries of :data:`hpcrl.config.verl_keys.VERL_KEYS` (module docstring)."""
