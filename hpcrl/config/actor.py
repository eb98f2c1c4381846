"""``actor``: the policy's optimizer, PPO loss, and how the trainer fits long responses and large models in
memory (token-budget micro-batches, padding-free packing, chunked log-probs, activation checkpointing, ZeRO
offload, sequence parallelism). verl's names where verl has the knob; docs/long-responses.md says which
settings a 7B-70B run with 8K-32K-token responses needs and what each one costs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from hpcrl.config import names
from hpcrl.config.algorithm import PolicyLossConfig
from hpcrl.config.checks import check_choice, check_float, check_int, fail
from hpcrl.config.lora import DEFAULT_TARGET_MODULES, validate_lora_fields


@dataclass
class ActorConfig:
    """``actor``: the policy's optimizer, PPO loss and DeepSpeed settings (verl's names)."""

    ppo_mini_batch_size: int = 4
    """Groups (prompts) per optimizer step (verl: ppo_mini_batch_size)."""
    ppo_micro_batch_size: int = 4
    """Groups per forward/backward on each trainer rank; gradient accumulation covers
    the rest of the rank's share of the mini-batch (unused with ``use_dynamic_bsz``, which counts tokens)."""
    use_dynamic_bsz: bool = False
    """Micro-batches by a token budget instead of a count of groups (verl's name): each rank's rows are packed
    into micro-batches of at most ``ppo_max_token_len_per_gpu`` tokens (prompt + response), the ranks' shares
    balanced by tokens, every rank running the same number of micro-batches (hpcrl/trainer/packing.py). What a
    micro-batch costs is then set by its tokens, whatever the lengths; the loss is the same (its denominators are
    the mini-batch's)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With ``use_dynamic_bsz``: tokens (prompt + response) per forward/backward on each GPU (trainer rank); a
    sequence-parallel group of sp ranks takes micro-batches of sp times this many, each rank holding its 1/sp (verl's
    name and meaning). A longer response runs alone. The memory of a micro-batch grows with this number, not with
    the longest response."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """With ``use_dynamic_bsz``: tokens per forward of the no-grad passes before the update (the trainer's
    log-probs, the reference's, old values; verl's ``log_prob_max_token_len_per_gpu``). null: twice
    ``ppo_max_token_len_per_gpu`` (no activations are kept for a backward)."""
    use_remove_padding: bool = True
    """Run the model on the rows of a micro-batch packed back to back, never padded (verl's
    ``actor_rollout_ref.model.use_remove_padding``): with a kernel that reads sequence boundaries from position ids
    (``flash_attention_2``/``_3``, ``flex_attention``) one packed forward; with ``sdpa``/``eager`` (which would need a
    mask quadratic in the pack) rows over 512 tokens alone and shorter ones padded together with at most 25 %
    padding. false: rows padded to the micro-batch's longest (hpcrl/trainer/forward.py)."""
    attn_implementation: str = "auto"
    """The trainer's attention kernel (transformers' ``attn_implementation``): ``auto`` (``flash_attention_2`` on a
    GPU where the flash-attn package is installed, else ``sdpa``), ``sdpa``, ``eager``, ``flash_attention_2``,
    ``flash_attention_3`` or ``flex_attention``."""
    logprob_chunk_mib: float = 256.0
    """The log-probs come from the final hidden states through the output layer a chunk of rows at a time (the
    whole logits, tokens x vocabulary, never exist): the most MiB of float32 logits one chunk holds (rows =
    this / (4 bytes x vocabulary); about three such blocks are alive at the peak). Checkpointed: the backward
    recomputes a chunk instead of keeping it (hpcrl/trainer/logprobs.py)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of the model's layers (verl's ``actor_rollout_ref.model.enable_gradient_checkpointing``):
    each layer's activations are recomputed in the backward pass instead of kept: per token and layer about three
    hidden-sized numbers instead of ~30 (hpcrl/plan/memory.py), for ~1/3 more compute."""
    offload_param: bool = False
    """ZeRO-3 parameter offload: the policy's parameters live in CPU memory and come to the GPU layer by layer
    (DeepSpeed ``offload_param``; verl's ``fsdp_config.param_offload``). Needs ``zero_stage: 3``."""
    offload_optimizer: bool = False
    """ZeRO optimizer-state offload: Adam's states and the fp32 master weights live in CPU memory, and the step runs
    there (DeepSpeed ``offload_optimizer``; verl's ``fsdp_config.optimizer_offload``). Needs ``zero_stage`` >= 1."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that share one sequence (DeepSpeed's Ulysses sequence parallelism; verl's name): each holds 1/sp of
    every micro-batch's tokens and attention heads are exchanged with all-to-all, so a response longer than one
    GPU holds is trained across sp GPUs. Must divide the trainer's ranks and the model's attention heads; the ranks
    of a group run the same micro-batches (``ppo_max_token_len_per_gpu`` x sp tokens each), the groups share the
    mini-batch as data-parallel ranks do."""
    ppo_epochs: int = 1
    """Passes over each local batch of R groups."""
    lr: float = 1e-3
    """Adam learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio: float = 0.2
    """PPO clip epsilon: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio]."""
    clip_ratio_low: Optional[float] = None
    """Lower clip epsilon (null = clip_ratio): the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: Optional[float] = None
    """Upper clip epsilon (null = clip_ratio; DAPO's clip-higher uses e.g. 0.28)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip bound c > 1: for tokens with negative advantage the loss is at most
    -A * c (null = plain PPO clip)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy loss (``loss_mode``) and its knobs (verl's ``actor.policy_loss``)."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (over the mini-batch; see hpcrl/trainer/losses.py)."""
    loss_scale_factor: Optional[int] = None
    """seq-mean-token-sum-norm divides the seq-mean-token-sum loss by this constant (null =
    rollout.response_length, verl's default: its padded response length)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: the tokens of a truncated response (one that hit rollout.response_length,
    finish reason ``length``) are masked out of the actor's losses (policy, entropy, KL); its reward still counts
    in its group's baseline, and advantages and the critic see it as before. verl has no such key (its DAPO recipe
    shapes the reward instead: reward.overlong_buffer); SkyRL's is generator.apply_overlong_filtering."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * agg(entropy of the tempered distribution)."""
    tau_pos: float = 1.0
    """sapo: temperature of the gate on tokens with A > 0 (verl's actor.tau_pos)."""
    tau_neg: float = 1.05
    """sapo: temperature of the gate on tokens with A <= 0 (verl's actor.tau_neg)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * agg(KL(pi_theta || reference)) to the loss (needs the reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss term: ``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``, ``abs``."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0..3."""
    bf16: Union[bool, str] = "auto"
    """Train in bf16 (DeepSpeed bf16 mode, fp32 master weights): ``auto`` (bf16 where the trainer runs on a
    GPU, fp32 on CPU), ``true`` or ``false``. fp16 is refused on CPU by DeepSpeed."""
    temperature: float = 1.0
    """Logits are divided by this when computing log-probs; keep it equal to
    rollout.temperature so trainer and engine log-probs agree."""
    lora_rank: Optional[int] = None
    """null: full fine-tuning (every weight is trained and published). An integer >= 1: a LoRA adapter of this
    rank is trained with peft on the frozen model (only the adapter is in the optimizer and the checkpoints),
    every weight version is the adapter alone, and the engines apply it to the same base model (verl:
    ``actor_rollout_ref.model.lora_rank``; its 0 is null here). The KL reference is the base model, the adapter
    switched off (no second copy)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank (verl: ``lora_alpha``)."""
    lora_target_modules: Union[list, str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Names of the modules that get an adapter (the last part of the module's name): by default the attention
    and MLP projections of Llama/Qwen-style layers, or ``all-linear`` (peft: every linear layer but the output
    layer; verl: ``target_modules``). Each name must be a linear layer of the model (checked at launch)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input in the trainer's forward passes, which run in training mode (the
    start-of-update log-probs too, when computed; the KL reference has the adapter off); 0 <= p < 1. The engines
    never drop."""

    @property
    def log_prob_token_budget(self) -> int:
        """Tokens per forward of the no-grad passes with ``use_dynamic_bsz`` (``log_prob_max_token_len_per_gpu``'s
        rule)."""
        if self.log_prob_max_token_len_per_gpu is not None:
            return self.log_prob_max_token_len_per_gpu
        return 2 * self.ppo_max_token_len_per_gpu

    def bf16_on(self, cuda: bool) -> bool:
        """Whether the trainer trains in bf16, ``cuda`` saying whether it runs on a GPU (``auto``'s rule)."""
        return cuda if self.bf16 == "auto" else bool(self.bf16)

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_int("actor.ppo_mini_batch_size", self.ppo_mini_batch_size, 1)
        check_int("actor.ppo_micro_batch_size", self.ppo_micro_batch_size, 1)
        check_choice("actor.use_dynamic_bsz", self.use_dynamic_bsz, (True, False))
        check_int("actor.ppo_max_token_len_per_gpu", self.ppo_max_token_len_per_gpu, 1)
        if self.log_prob_max_token_len_per_gpu is not None:
            check_int("actor.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len_per_gpu, 1)
        check_choice("actor.use_remove_padding", self.use_remove_padding, (True, False))
        check_choice("actor.attn_implementation", self.attn_implementation, names.ATTN_IMPLEMENTATIONS)
        check_float("actor.logprob_chunk_mib", self.logprob_chunk_mib, 0.0, lo_open=True)
        check_choice("actor.gradient_checkpointing", self.gradient_checkpointing, (True, False))
        check_choice("actor.offload_param", self.offload_param, (True, False))
        check_choice("actor.offload_optimizer", self.offload_optimizer, (True, False))
        check_int("actor.ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size, 1)
        check_int("actor.ppo_epochs", self.ppo_epochs, 1)
        check_float("actor.lr", self.lr, 0.0, lo_open=True)
        check_float("actor.weight_decay", self.weight_decay, 0.0)
        check_float("actor.clip_ratio", self.clip_ratio, 0.0, 1.0, lo_open=True)
        if self.clip_ratio_low is not None:
            check_float("actor.clip_ratio_low", self.clip_ratio_low, 0.0, 1.0, lo_open=True)
        if self.clip_ratio_high is not None:
            check_float("actor.clip_ratio_high", self.clip_ratio_high, 0.0, lo_open=True)
        if self.clip_ratio_c is not None and (isinstance(self.clip_ratio_c, bool) or self.clip_ratio_c <= 1.0):
            fail("actor.clip_ratio_c", self.clip_ratio_c, "a number > 1 or null",
                  "use e.g. 3.0 for dual-clip PPO, or null to turn it off")
        self.policy_loss.validate()
        check_choice("actor.loss_agg_mode", self.loss_agg_mode, names.LOSS_AGG_MODES)
        if self.loss_scale_factor is not None:
            check_int("actor.loss_scale_factor", self.loss_scale_factor, 1)
        check_choice("actor.overlong_filter", self.overlong_filter, (True, False))
        check_float("actor.entropy_coeff", self.entropy_coeff, 0.0)
        check_float("actor.tau_pos", self.tau_pos, 0.0, lo_open=True)
        check_float("actor.tau_neg", self.tau_neg, 0.0, lo_open=True)
        check_choice("actor.use_kl_loss", self.use_kl_loss, (True, False))
        check_float("actor.kl_loss_coef", self.kl_loss_coef, 0.0)
        check_choice("actor.kl_loss_type", self.kl_loss_type, names.KL_ESTIMATORS)
        check_float("actor.grad_clip", self.grad_clip, 0.0)
        check_int("actor.zero_stage", self.zero_stage, 0, 3)
        if self.offload_param and self.zero_stage != 3:
            fail("actor.offload_param", True, "only with actor.zero_stage: 3 (parameters are offloaded as ZeRO-3 "
                 "partitions)", "set actor.zero_stage=3, or actor.offload_param=false")
        if self.offload_optimizer and self.zero_stage == 0:
            fail("actor.offload_optimizer", True, "only with actor.zero_stage >= 1 (the optimizer states offloaded "
                 "are ZeRO's partitions)", "set actor.zero_stage=1, 2 or 3, or actor.offload_optimizer=false")
        check_choice("actor.bf16", self.bf16, (True, False, "auto"))
        check_float("actor.temperature", self.temperature, 0.0, lo_open=True)
        validate_lora_fields(self)
