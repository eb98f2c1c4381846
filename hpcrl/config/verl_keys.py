"""verl's config keys as hpcrl reads them (:data:`VERL_KEYS`, one flat table: verl's dotted key -> hpcrl's key, or a
:class:`VerlKey` that says more), defined once, at the bottom layer. ``verl.py`` applies the table where ``run.py``
builds the config tree, ``verl_units.py`` converts the values whose units differ, and docs/verl.md shows it. The
reward model's entries are written in ``verl_reward.py``; :class:`VerlKey` lives in ``verl_key.py``, which both import.
"""
from __future__ import annotations

from hpcrl.config.verl_key import VerlKey
from hpcrl.config.verl_reward import REWARD_MODEL_KEYS

__all__ = ["VERL_KEYS", "VerlKey"]


_SHARDING = "the trainer shards with DeepSpeed ZeRO (actor.zero_stage 0-3; FSDP's full sharding is ZeRO-3)"
_RAY = "hpcrl runs no Ray: the trainer and each rollout job are Slurm jobs (resources.*)"
_PROFILE = "no profiler hooks: bench/ measures the exchanges, logs/*.jsonl time every step"
_CKPT = "checkpoints hold model, optimizer and sample cursor in RUN/checkpoints (trainer.checkpoint_every_updates)"
_CRITIC_BATCHES = ("the critic (a value head on the policy) trains on the actor's micro-batches (actor.use_dynamic_bsz, "
                   "actor.ppo_max_token_len_per_gpu)")
_ENGINE = "a vLLM engine option hpcrl does not set (the rollout.* fields list the ones it does)"
_MODEL = "the model is model.path loaded as it is (no kernel options; LoRA: actor.lora_*)"
_TP = ("parallel training is DeepSpeed ZeRO data parallelism with Ulysses sequence parallelism "
       "(actor.ulysses_sequence_parallel_size); no tensor or pipeline parallelism")
_CHUNKS = "log-probs and entropy always come from the hidden states a chunk at a time (actor.logprob_chunk_mib)"
_OPTIM_KEYS = ("optimizer", "optimizer_impl", "lr", "lr_warmup_steps_ratio", "lr_warmup_ratio", "total_training_steps",
               "weight_decay", "lr_warmup_steps", "betas", "clip_grad", "grad_clip", "max_grad_norm", "min_lr_ratio",
               "num_cycles", "lr_scheduler_type", "warmup_style", "override_optimizer_config", "lr_warmup_init",
               "lr_decay_steps", "lr_decay_style", "min_lr", "weight_decay_incr_style", "lr_wsd_decay_style",
               "lr_wsd_decay_steps", "use_checkpoint_opt_param_scheduler")
"""verl 0.9.1's optimizer keys (its FSDP, Megatron and VeOmni optimizer configs): a typo such as ``optim.lrr`` is
refused, not read as one of them."""

VERL_KEYS: dict[str, str | VerlKey] = {
    # ---- data
    "data.train_files": VerlKey("data.source", "one file (a list of one file is read as that file)"),
    "data.max_response_length": "rollout.response_length",
    "data.filter_overlong_prompts": VerlKey("data.truncation", "true: prompts over data.max_prompt_length are "
                                            "filtered out and counted (data.truncation=filter)"),
    "data.train_batch_size": VerlKey("async_training.require_batches", "prompts per trainer update: R = "
                                     "actor.ppo_mini_batch_size * async_training.require_batches; 0 (what verl's "
                                     "fully_async asks for) leaves R as it is"),
    "data.gen_batch_size": VerlKey(None, "a rollout job starts groups one at a time, up to "
                                   "rollout.max_concurrent_groups (verl's fully_async asks for 1)"),
    "data.shuffle": VerlKey(None, "prompts are always shuffled: one seeded permutation per epoch (data.seed)"),
    "data.validation_shuffle": VerlKey(None, "held-out prompts are read in file order (eval.max_prompts keeps a "
                                       "seeded subset, the same for every version)"),
    "data.return_raw_chat": VerlKey(None, "the rollout job renders the chat template itself"),
    "data.return_raw_input_ids": VerlKey(None, "the rollout job renders the chat template itself"),
    "data.return_full_prompt": VerlKey(None, "the rollout job renders the chat template itself"),
    "data.apply_chat_template_kwargs": VerlKey(None, "the chat template is applied with add_generation_prompt only",
                                               refuse=True),
    "data.dataloader_num_workers": VerlKey(None, "prompts are read once at start: no data loader workers"),
    "data.filter_overlong_prompts_workers": VerlKey(None, "prompts are read once at start: no data loader workers"),
    "data.reward_fn_key": VerlKey(None, "the reward's data_source is the row's data_source column"),
    "data.tokenizer": VerlKey(None, "the tokenizer is model.path's own", refuse=True),
    "data.use_shm": VerlKey(None, "prompts are read from the file directly"),
    "data.train_max_samples": VerlKey(None, "every row of data.source is used; cut the file to use fewer"),
    "data.trust_remote_code": VerlKey(None, "no remote code is run: a local folder of a transformers model class"),
    "data.tool_config_path": VerlKey("agent.tools", "tools are listed in agent.tools (hpcrl/rollout/tools.py)",
                                     refuse=True),
    "data.function_tool_path": VerlKey("agent.tools", "tools are listed in agent.tools (hpcrl/rollout/tools.py)",
                                       refuse=True),
    "data.custom_cls.*": VerlKey(None, "rows are read in verl's format by hpcrl/rollout/data.py", refuse=True),
    "data.sampler.*": VerlKey(None, "prompts are read in a seeded permutation per epoch", refuse=True),
    "data.image_key": VerlKey(None, "text only: no images are read"),
    "data.video_key": VerlKey(None, "text only: no videos are read"),
    "data.audio_key": VerlKey(None, "text only: no audio is read"),
    "data.image_patch_size": VerlKey(None, "text only: no images are read"),
    "data.return_multi_modal_inputs": VerlKey(None, "text only"),
    "data.mm_processor_kwargs": VerlKey(None, "text only", refuse=True),
    # ---- the model, the actor and its optimizer
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.lora_rank": VerlKey("actor.lora_rank", "0: full fine-tuning (null here); > 0: a LoRA "
                                                 "adapter of that rank"),
    "actor_rollout_ref.model.lora.rank": VerlKey("actor.lora_rank", "0: full fine-tuning (null here); > 0: a LoRA "
                                                 "adapter of that rank"),
    "actor_rollout_ref.model.lora_alpha": "actor.lora_alpha",
    "actor_rollout_ref.model.lora.alpha": "actor.lora_alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora_target_modules",
    "actor_rollout_ref.model.lora.target_modules": "actor.lora_target_modules",
    "actor_rollout_ref.model.exclude_modules": VerlKey(None, "the adapted modules are named in "
                                                       "actor.lora_target_modules (list the ones to adapt)", refuse=True),
    "actor_rollout_ref.model.custom_chat_template": VerlKey(None, "the chat template is the tokenizer's (save it "
                                                            "into model.path)", refuse=True),
    "actor_rollout_ref.model.tokenizer_path": VerlKey(None, "the tokenizer is model.path's own", refuse=True),
    "actor_rollout_ref.model.hf_config_path": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.use_shm": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.trust_remote_code": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.external_lib": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.override_config": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.gradient_checkpointing",
    "actor_rollout_ref.model.enable_activation_offload": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.use_remove_padding": "actor.use_remove_padding",
    "actor_rollout_ref.model.use_liger": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.use_fused_kernels": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.fused_kernel_options.*": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.tiled_mlp.*": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.mtp.*": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.lora.*": VerlKey(None, _MODEL),
    "actor_rollout_ref.model.lora_adapter_path": VerlKey(None, "training starts from a fresh adapter on model.path; "
                                                         "to start from yours, merge it into the model first "
                                                         "(peft's merge_and_unload) and point model.path at that",
                                                         refuse=True),
    "actor_rollout_ref.hybrid_engine": VerlKey(None, "the trainer and the rollout always run as separate jobs"),
    "actor_rollout_ref.nccl_timeout": VerlKey(None, "every wait has its own limit in timeouts.*"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": VerlKey(None, "the reference's passes follow actor.use_dynamic_bsz"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": VerlKey(None, "the reference follows actor.offload_param (a "
                                                               "ZeRO-3 engine of its own under actor.zero_stage=3)"),
    "actor_rollout_ref.ref.*": VerlKey(None, "the reference policy is model.path, loaded in the trainer when a KL "
                                       "term needs it (actor.use_kl_loss, algorithm.use_kl_in_reward)"),
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.weight_decay",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.grad_clip",
    "actor_rollout_ref.actor.optim.*": VerlKey(None, "AdamW with a constant actor.lr (no warm-up or schedule)",
                                               keys=_OPTIM_KEYS),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": VerlKey("actor.ppo_micro_batch_size", "sequences per "
                                                                    "GPU are read as groups of rollout.n per rank"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": VerlKey("actor.ppo_micro_batch_size", "sequences over all GPUs "
                                                            "are read as groups of rollout.n per rank"),
    "actor_rollout_ref.actor.use_rollout_log_probs": "async_training.use_rollout_log_probs",
    "actor_rollout_ref.actor.strategy": VerlKey(None, _SHARDING),
    "actor_rollout_ref.actor.fsdp_config.param_offload": VerlKey("actor.offload_param", "DeepSpeed's ZeRO-3 parameter "
                                                                 "offload (needs actor.zero_stage=3)"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": VerlKey("actor.offload_optimizer", "DeepSpeed's ZeRO "
                                                                     "optimizer offload (needs actor.zero_stage >= 1)"),
    "actor_rollout_ref.actor.fsdp_config.*": VerlKey(None, _SHARDING),
    "actor_rollout_ref.actor.megatron.*": VerlKey(None, _TP),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.rollout_n": VerlKey(None, "rollout.n is the group size"),
    "actor_rollout_ref.actor.checkpoint.*": VerlKey(None, _CKPT),
    "actor_rollout_ref.actor.profiler.*": VerlKey(None, _PROFILE),
    "actor_rollout_ref.actor.qat.*": VerlKey(None, "no quantization-aware training"),
    "actor_rollout_ref.actor.shuffle": VerlKey(None, "each update's groups are used in commit order"),
    "actor_rollout_ref.actor.data_loader_seed": VerlKey(None, "the trainer's seed is model.seed"),
    "actor_rollout_ref.actor.calculate_entropy": VerlKey(None, "actor/entropy is always logged"),
    "actor_rollout_ref.actor.calculate_sum_pi_squared": VerlKey(None, "the optimal-token baseline computes what it "
                                                                "needs"),
    "actor_rollout_ref.actor.use_torch_compile": VerlKey(None, "eager PyTorch under DeepSpeed"),
    "actor_rollout_ref.actor.use_fused_kernels": VerlKey(None, "eager PyTorch under DeepSpeed"),
    "actor_rollout_ref.actor.use_remove_padding": "actor.use_remove_padding",
    "actor_rollout_ref.actor.pad_to_length": VerlKey(None, "rows are packed (actor.use_remove_padding) or padded to "
                                                     "their micro-batch's longest"),
    "actor_rollout_ref.actor.use_prefix_grouper": VerlKey(None, "each trajectory is a full sequence", refuse=True),
    "actor_rollout_ref.actor.freeze_vision_tower": VerlKey(None, "text only"),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": VerlKey(None, _CHUNKS),
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size": VerlKey(None, _CHUNKS + ", set in MiB of logits"),
    "actor_rollout_ref.actor.entropy_checkpointing": VerlKey(None, _CHUNKS + ", each checkpointed"),
    "actor_rollout_ref.actor.*": "actor.*",
    # ---- the rollout engine
    "actor_rollout_ref.rollout.name": VerlKey("rollout.engine", "vllm -> vllm, hf -> transformers"),
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": VerlKey("rollout.temperature", "also actor.temperature (the "
                                                     "trainer's log-probs use the same one, as verl's do)"),
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": VerlKey(None, "no top-k sampling (-1 is what verl means by off)"),
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "rollout.response_length",
    "actor_rollout_ref.rollout.dtype": "rollout.dtype",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_num_seqs",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.data_parallel_size": "rollout.data_parallel_size",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": VerlKey(None, "vLLM runs tensor (and data) parallel "
                                                                      "only"),
    "actor_rollout_ref.rollout.expert_parallel_size": VerlKey(None, "vLLM runs tensor (and data) parallel only"),
    "actor_rollout_ref.rollout.nnodes": VerlKey(None, "a rollout job runs on one node (resources.rollout_jobs adds "
                                                "more)"),
    "actor_rollout_ref.rollout.n_gpus_per_node": VerlKey(None, "rollout GPUs are resources.rollout.gpus_per_node "
                                                         "per rollout job"),
    "actor_rollout_ref.rollout.calculate_log_probs": VerlKey(None, "the engine's log-prob of every sampled token is "
                                                             "always kept"),
    "actor_rollout_ref.rollout.logprobs_mode": VerlKey(None, "the engine's processed log-probs (after temperature "
                                                       "and top-p) are kept: the behaviour policy"),
    "actor_rollout_ref.rollout.mode": VerlKey(None, "vLLM's AsyncLLM runs inside the rollout job"),
    "actor_rollout_ref.rollout.do_sample": VerlKey(None, "training rollouts always sample"),
    "actor_rollout_ref.rollout.ignore_eos": VerlKey(None, "a response ends at EOS or rollout.response_length",
                                                    refuse=True),
    "actor_rollout_ref.rollout.seed": VerlKey(None, "each group's seed comes from data.seed and its prompt index"),
    "actor_rollout_ref.rollout.over_sample_rate": VerlKey(None, "every admitted group is finished (partial rollout "
                                                          "continues it across versions)", refuse=True),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": "weights.bucket_mib",
    "actor_rollout_ref.rollout.checkpoint_engine.*": VerlKey(None, "weights travel as verified files, and by "
                                                             "broadcast with weights.transport=broadcast|auto"),
    "actor_rollout_ref.rollout.multi_turn.enable": VerlKey("agent.default", "multi-turn is agent.default="
                                                           "tool_agent with agent.tools", refuse=True),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "agent.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": "agent.max_user_turns",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "agent.max_parallel_calls",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "agent.max_tool_response_chars",
    "actor_rollout_ref.rollout.multi_turn.format": "agent.tool_parser",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": VerlKey("agent.tools", "tools are listed in "
                                                                     "agent.tools (hpcrl/rollout/tools.py)",
                                                                     refuse=True),
    "actor_rollout_ref.rollout.multi_turn.*": VerlKey(None, "the tool agent's own rules (hpcrl/rollout/tool_agent.py)"),
    "actor_rollout_ref.rollout.agent.default_agent_loop": VerlKey("agent.default", "single_turn_agent -> "
                                                                  "single_turn, tool_agent -> tool_agent"),
    "actor_rollout_ref.rollout.agent.*": VerlKey(None, "agent loops run as threads of the rollout job "
                                                 "(rollout.max_concurrent_groups)"),
    "actor_rollout_ref.rollout.profiler.*": VerlKey(None, _PROFILE),
    "actor_rollout_ref.rollout.trace.*": VerlKey(None, _PROFILE),
    "actor_rollout_ref.rollout.prometheus.*": VerlKey(None, _PROFILE),
    "actor_rollout_ref.rollout.quantization": VerlKey(None, "the engine runs rollout.dtype weights", refuse=True),
    "actor_rollout_ref.rollout.engine_kwargs.*": VerlKey(None, _ENGINE, refuse=True),
    "actor_rollout_ref.rollout.disaggregation.*": VerlKey(None, "prefill and decode run in one engine"),
    "actor_rollout_ref.rollout.full_determinism": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.free_cache_engine": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.max_num_batched_tokens": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.enable_chunked_prefill": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.enable_prefix_caching": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.scheduling_policy": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.load_format": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.layered_summon": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": VerlKey(None, "the trainer's no-grad passes follow "
                                                                  "actor.use_dynamic_bsz"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.disable_log_stats": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.multi_stage_wake_up": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.router_config_path": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.skip_tokenizer_init": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.quantization_config_file": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.mtp": VerlKey(None, _ENGINE),
    "actor_rollout_ref.rollout.qat": VerlKey(None, _ENGINE),
    # ---- fully_async's own sections
    "rollout.nnodes": VerlKey("resources.rollout_jobs", "rollout GPUs (nnodes x n_gpus_per_node) become one rollout "
                              "job per vLLM replica of tensor_model_parallel_size GPUs"),
    "rollout.n_gpus_per_node": VerlKey("resources.rollout.gpus_per_node", "rollout GPUs (nnodes x n_gpus_per_node) "
                                       "become one rollout job per vLLM replica of tensor_model_parallel_size GPUs"),
    "async_training.use_trainer_do_validate": VerlKey(None, "validation runs in its own evaluation job (eval.*, "
                                                      "resources.eval), never on the trainer"),
    "async_training.use_dynamic_resource_scheduling": VerlKey(None, "each job keeps its own allocation",
                                                              refuse=True),
    "async_training.dynamic_schedule_policy": VerlKey(None, "each job keeps its own allocation"),
    "async_training.dynamic_schedule_deactivate_ratio": VerlKey(None, "each job keeps its own allocation"),
    "async_training.dynamic_schedule_enable_rebalance": VerlKey(None, "each job keeps its own allocation"),
    "async_training.concurrent_samples_per_replica": VerlKey("rollout.max_concurrent_groups", "requests per vLLM "
                                                             "replica are read as groups of rollout.n per rollout job"),
    "async_training.checkpoint_engine.*": VerlKey(None, "weights travel as verified files, and by broadcast with "
                                                  "weights.transport=broadcast|auto"),
    # ---- the trainer
    "trainer.nnodes": "resources.trainer.nodes",
    "trainer.n_gpus_per_node": VerlKey("resources.trainer.gpus_per_node", "one DeepSpeed rank per GPU: also "
                                       "resources.trainer.tasks_per_node"),
    "trainer.total_epochs": "data.epochs",
    "trainer.total_training_steps": VerlKey("rollout.total_rollout_steps", "updates x R groups "
                                            "(R = actor.ppo_mini_batch_size * async_training.require_batches)"),
    "trainer.save_freq": VerlKey("trainer.checkpoint_every_updates", "-1 (never) is not offered: a resume needs "
                                 "checkpoints, so the default is kept"),
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_checkpoints",
    "trainer.max_critic_ckpt_to_keep": VerlKey(None, "the critic is saved with the actor (trainer.keep_checkpoints)"),
    "trainer.logger": VerlKey("logging.backends", "console is hpcrl run's own output; jsonl is always written"),
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.experiment_name",
    "trainer.default_local_dir": VerlKey(None, "checkpoints go to RUN/checkpoints (--run-dir)"),
    "trainer.default_hdfs_dir": VerlKey(None, "checkpoints go to RUN/checkpoints (--run-dir)"),
    "trainer.resume_mode": VerlKey(None, "`hpcrl run --resume --run-dir RUN` resumes from RUN's newest checkpoint"),
    "trainer.resume_from_path": VerlKey(None, "`hpcrl run --resume --run-dir RUN` resumes from RUN's newest "
                                        "checkpoint", refuse=True),
    "trainer.del_local_ckpt_after_load": VerlKey(None, _CKPT),
    "trainer.checkpoint_callback_class": VerlKey(None, _CKPT, refuse=True),
    "trainer.device": VerlKey(None, "a job uses cuda when it sees GPUs (resources.*.gpus_per_node), else cpu"),
    "trainer.balance_batch": VerlKey(None, "each rank takes an equal share of every mini-batch"),
    "trainer.critic_warmup": VerlKey(None, "the critic trains from the first update", refuse=True),
    "trainer.log_val_generations": VerlKey(None, "`hpcrl samples RUN` prints sampled responses; "
                                           "logging.show_samples shows one under the version lines"),
    "trainer.rollout_data_dir": VerlKey(None, "every sample is kept in RUN/samples (read with `hpcrl samples RUN`)"),
    "trainer.validation_data_dir": VerlKey(None, "every validation response goes to RUN/logs/eval_samples.jsonl.gz"),
    "trainer.test_freq": "eval.every_versions",
    "trainer.val_before_train": "eval.before_training",
    "actor_rollout_ref.rollout.val_kwargs.n": "eval.n",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "eval.do_sample",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "eval.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "eval.top_p",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "eval.top_k",
    "trainer.esi_redundant_time": VerlKey(None, "Slurm sends USR2 90 s before the time limit; the trainer "
                                          "checkpoints then"),
    "trainer.ray_wait_register_center_timeout": VerlKey(None, _RAY),
    "trainer.use_legacy_worker_impl": VerlKey(None, "hpcrl has one trainer"),
    "trainer.use_v1": VerlKey(None, "hpcrl has one trainer"),
    "trainer.v1.*": VerlKey(None, "hpcrl has one trainer"),
    "trainer.val_only": VerlKey(None, "`hpcrl eval RUN --versions ...` evaluates published versions without "
                                "training", refuse=True),
    # ---- the critic (a value head on the policy)
    "critic.optim.lr": "critic.lr",
    "critic.optim.*": VerlKey(None, "AdamW with a constant critic.lr", keys=_OPTIM_KEYS),
    "critic.model.*": VerlKey(None, "the critic is a value head on the policy (hpcrl/trainer/models.py)"),
    "critic.fsdp.*": VerlKey(None, _SHARDING),
    "critic.fsdp_config.*": VerlKey(None, _SHARDING),
    "critic.checkpoint.*": VerlKey(None, _CKPT),
    "critic.strategy": VerlKey(None, _SHARDING),
    "critic.enable": VerlKey(None, "the critic is used when the estimator needs values (algorithm.adv_estimator=gae)"),
    "critic.rollout_n": VerlKey(None, "rollout.n is the group size"),
    "critic.ppo_mini_batch_size": VerlKey(None, "the critic trains on the actor's mini-batches"),
    "critic.ppo_micro_batch_size": VerlKey(None, "the critic trains on the actor's micro-batches"),
    "critic.ppo_micro_batch_size_per_gpu": VerlKey(None, "the critic trains on the actor's micro-batches"),
    "critic.forward_micro_batch_size": VerlKey(None, "the critic trains on the actor's micro-batches"),
    "critic.forward_micro_batch_size_per_gpu": VerlKey(None, "the critic trains on the actor's micro-batches"),
    "critic.use_dynamic_bsz": VerlKey(None, _CRITIC_BATCHES),
    "critic.ppo_max_token_len_per_gpu": VerlKey(None, _CRITIC_BATCHES),
    "critic.forward_max_token_len_per_gpu": VerlKey(None, _CRITIC_BATCHES),
    "critic.ppo_epochs": VerlKey(None, "the critic makes actor.ppo_epochs passes with the actor"),
    "critic.shuffle": VerlKey(None, "each update's groups are used in commit order"),
    "critic.data_loader_seed": VerlKey(None, "the trainer's seed is model.seed"),
    "critic.loss_agg_mode": VerlKey(None, "the value loss is averaged over response tokens"),
    "critic.loss_scale_factor": VerlKey(None, "the value loss is averaged over response tokens"),
    "critic.ulysses_sequence_parallel_size": VerlKey(None, "the value head shares the actor's sequence parallelism "
                                                     "(actor.ulysses_sequence_parallel_size)"),
    "critic.grad_clip": VerlKey(None, "the critic's gradients are clipped with the actor's (actor.grad_clip)"),
    "critic.profiler.*": VerlKey(None, _PROFILE),
    # ---- rewards
    "custom_reward_function.path": "reward.path",
    "custom_reward_function.name": "reward.function",
    "custom_reward_function.reward_kwargs": "reward.kwargs",
    "reward.custom_reward_function.path": "reward.path",
    "reward.custom_reward_function.name": "reward.function",
    "reward.custom_reward_function.reward_kwargs": "reward.kwargs",
    "reward_model.reward_manager": VerlKey("reward.name", "naive: one call per response, the scorer chosen by "
                                           "data_source (reward.name=by_data_source) unless reward.path is set"),
    "reward_model.overlong_buffer.*": VerlKey("reward.overlong_buffer.*", "DAPO's overlong reward shaping, added to "
                                              "the score in the rollout job (recipe/dapo's keys)"),
    "custom_reward_function.overlong_buffer.*": VerlKey("reward.overlong_buffer.*", "DAPO's overlong reward "
                                                        "shaping (recipe/dapo's early 32B script's keys)"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.*": VerlKey("reward.overlong_buffer.*", "DAPO's overlong reward "
                                                               "shaping (the DAPO reward manager's keys, as verl's "
                                                               "fully_async scripts pass them)"),
    "reward_model.reward_kwargs.max_resp_len": VerlKey("reward.overlong_buffer.max_resp_len", "the limit of the "
                                                       "overlong buffer (rollout.response_length when not given)"),
    "reward.reward_manager.name": VerlKey("reward.name", "naive: one call per response, the scorer chosen by "
                                          "data_source (reward.name=by_data_source) unless reward.path is set"),
    "reward.reward_manager.*": VerlKey(None, "the naive reward manager: one call per response in the rollout job"),
    **REWARD_MODEL_KEYS,
    "reward.num_workers": VerlKey(None, "rule rewards run in the rollout job's group threads; a reward job batches "
                                  "the model's requests itself (reward_model.micro_batch_size)"),
    "reward.sandbox_fusion.*": VerlKey(None, "code runs in the python tool's sandbox (agent.tools)"),
    "sandbox_fusion.*": VerlKey(None, "code runs in the python tool's sandbox (agent.tools)"),
    # ---- infrastructure hpcrl does without
    "hydra.*": VerlKey(None, "the file is read alone: verl's defaults are hpcrl's own (hpcrl/config/)"),
    "defaults": VerlKey(None, "the file is read alone: verl's defaults are hpcrl's own (hpcrl/config/)"),
    "ray_kwargs.*": VerlKey(None, _RAY),
    "ray_init.*": VerlKey(None, _RAY),
    "global_profiler.*": VerlKey(None, _PROFILE),
    "transfer_queue.enable": VerlKey(None, "samples go through HDF5 shards in RUN/samples", refuse=True),
    "transfer_queue.*": VerlKey(None, "samples go through HDF5 shards in RUN/samples"),
    "skip.*": VerlKey(None, "every rollout is generated"),
    "distillation.enabled": VerlKey(None, "no distillation", refuse=True),
    "distillation.*": VerlKey(None, "no distillation"),
}
"""verl's config keys (0.9.1, its ``fully_async_policy`` included) as hpcrl reads them, in YAML files
and ``key=value`` overrides alike (hpcrl/config/verl.py applies it; the table in docs/verl.md is this one).
A plain string is the hpcrl key that takes the value as it is; a :class:`VerlKey` says more, or that
the key has no meaning here. A key ending in ``.*`` covers every key under that prefix; an exact
entry wins over it, a longer prefix over a shorter one. A key hpcrl also has (``rollout.n``,
``algorithm.*``, ``async_training.*`` ...) is read as hpcrl's own. Where the units differ (verl's
micro-batches count sequences, hpcrl's groups) hpcrl/config/verl.py converts the value and says how."""
