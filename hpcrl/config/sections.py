"""Config sections of the jobs: model, data, reward, rollout, agent, async knobs,
trainer, weights (the actor's is :mod:`hpcrl.config.actor`). One dataclass each, a docstring under every field, one default per field;
``validate()`` names the key, what is allowed and the fix. Built and cross-checked by
:mod:`hpcrl.config.run`; the algorithm sections are in :mod:`hpcrl.config.algorithm`, the job
sizes in :mod:`hpcrl.config.resources`, timeouts and logging in :mod:`hpcrl.config.runtime`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from hpcrl.config import names, registries
from hpcrl.config.checks import check_choice, check_float, check_int, fail
from hpcrl.config.dapo import OverlongBufferConfig

@dataclass
class ModelConfig:
    """``model``: which model both jobs start from."""

    path: str = "builtin:tiny"
    """A local Hugging Face model folder (config.json, weights, tokenizer), or
    ``builtin:tiny`` to build the tiny Qwen2-style model and tokenizer locally
    at launch (nothing is downloaded; ``builtin:tiny-h64``: the same with head dim 64,
    which vLLM's CPU build can serve). ``~`` is expanded. The folder is checked at
    launch (``hpcrl run``, also with ``--dry-run``), not when the config is parsed, so
    a shipped config may hold a placeholder path."""
    seed: int = 0
    """Seed for building ``builtin:tiny`` (random init) and for the trainer."""
    base_hash: Optional[str] = None
    """LoRA runs (``actor.lora_rank``): the hash of the model folder's weight files (``xxh3_128:<hex>``), which the
    launcher writes into the frozen config; every job checks that the folder still has it before it applies an
    adapter version to it (an adapter means nothing on another base). Leave it null: a value given is checked
    against the folder at launch."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        if not isinstance(self.path, str) or not self.path.strip():
            fail("model.path", self.path, f"{' or '.join(names.BUILTIN_MODELS)} or a local HF model folder")
        check_int("model.seed", self.seed, 0)
        if self.base_hash is not None and (not isinstance(self.base_hash, str) or ":" not in self.base_hash):
            fail("model.base_hash", self.base_hash, "null (the launcher fills it in) or ALGORITHM:HEX",
                 "leave model.base_hash out")


@dataclass
class DataConfig:
    """``data``: where the prompts come from, how they become tokens, in which order.
    Files in verl's format work unchanged (``prompt`` = chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``; hpcrl/rollout/data.py)."""

    source: str = "builtin:toy"
    """``builtin:toy`` (the generated toy task), ``builtin:toy_calc`` (the multi-turn calculator
    task, for the tool agent) or a local ``.jsonl`` / ``.parquet``
    file with one prompt per row (``~`` is expanded; checked at launch)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages ``[{role, content}, ...]`` (verl)
    or a string (files only)."""
    answer_key: str = "reward_model.ground_truth"
    """Column handed to the reward function as the ground truth; dots go into nested
    columns (verl: ``reward_model.ground_truth``). A file none of whose rows has it is refused at launch with a
    built-in reward (every response would score 0), and warned about with a function of yours (``reward.path``)."""
    apply_chat_template: Optional[bool] = None
    """Render the prompt with the tokenizer's chat template, generation prompt added
    (a string prompt becomes one user message). null = yes when the tokenizer has a
    template; true on a tokenizer without one fails at launch."""
    max_prompt_length: Optional[int] = None
    """Longest prompt in tokens (after the chat template); null = no limit."""
    truncation: str = "filter"
    """A prompt over max_prompt_length is ``filter``ed out (counted in the rollout job's log),
    cut on the ``left`` or ``right`` (counted), or is an ``error`` at launch."""
    seed: int = 0
    """Seed of the prompt order; each epoch is a new permutation of it."""
    epochs: Optional[int] = None
    """Passes over the prompts (verl: ``trainer.total_epochs``). When set, the launcher makes
    ``rollout.total_rollout_steps`` = epochs x prompts kept (after max_prompt_length's filter), at most
    the value given there (verl takes the same minimum), and prints it. null: total_rollout_steps alone."""
    toy_num_prompts: int = 512
    """Number of distinct prompts the toy generator makes (builtin:toy only)."""
    val_files: Union[list, str] = field(default_factory=list)
    """Held-out prompts of the evaluation job (``eval``; verl: ``data.val_files``): a file or a list of
    ``.jsonl`` / ``.parquet`` files in the same format as ``data.source`` (each row keeps its
    ``data_source``: the metrics are per data source), or ``builtin:toy_heldout``. Checked at launch."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        if self.source not in names.BUILTIN_DATA and Path(self.source).suffix not in (".jsonl", ".parquet"):
            fail("data.source", self.source, f"{' or '.join(names.BUILTIN_DATA)} or a .jsonl/.parquet file")
        if isinstance(self.val_files, str):  # verl writes one file as a string
            self.val_files = [self.val_files]
        for f in self.val_files:
            if not isinstance(f, str) or (f not in names.BUILTIN_DATA and Path(f).suffix not in (".jsonl", ".parquet")):
                fail("data.val_files", f, f"{' or '.join(names.BUILTIN_DATA)} or .jsonl/.parquet files")
        check_choice("data.apply_chat_template", self.apply_chat_template, (None, True, False))
        if self.max_prompt_length is not None:
            check_int("data.max_prompt_length", self.max_prompt_length, 1)
        check_choice("data.truncation", self.truncation, names.TRUNCATIONS)
        check_int("data.seed", self.seed, 0)
        if self.epochs is not None:
            check_int("data.epochs", self.epochs, 1)
        check_int("data.toy_num_prompts", self.toy_num_prompts, 1)


@dataclass
class RewardConfig:
    """``reward``: how a response is scored: a built-in rule, or your own function called as verl
    calls it, ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs)``
    (only the names it accepts are passed; hpcrl/rollout/reward_fn.py)."""

    name: str = "by_data_source"
    """Built-in reward (:func:`hpcrl.config.registries.reward_names`), used when reward.path is null:
    ``by_data_source`` picks the rule from each row's ``data_source`` as verl's default_compute_score
    does (``openai/gsm8k`` -> ``gsm8k``, the MATH sources -> ``math_verify``, ``builtin:toy`` ->
    ``toy_copy``); ``math_verify`` checks the final answer with the math-verify package, ``gsm8k``
    the ``#### answer`` convention."""
    path: Optional[str] = None
    """A Python file defining the reward function (verl: custom_reward_function.path).
    It is imported and called once on the first prompt at launch; at run time an exception
    gives reward 0 and is counted and logged with the sample id."""
    function: str = "compute_score"
    """Name of the function in reward.path (verl: custom_reward_function.name). It returns a
    float, or a dict whose ``score`` is the reward and whose other numbers become metrics."""
    kwargs: dict = field(default_factory=dict)
    """More keyword arguments for every call (verl: custom_reward_function.reward_kwargs), e.g.
    ``{method: flexible}`` for verl's gsm8k scorer; each must be a parameter of the function."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong punishment, added to the score in the rollout job (verl's DAPO reward manager;
    hpcrl/config/dapo.py)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("reward.name", self.name, registries.reward_names())
        if self.path is not None and Path(self.path).suffix != ".py":
            fail("reward.path", self.path, "null or a .py file", "point reward.path at your reward file")
        if not isinstance(self.function, str) or not self.function.isidentifier():
            fail("reward.function", self.function, "a Python function name")
        for k in self.kwargs:
            if not isinstance(k, str) or not k.isidentifier():
                fail("reward.kwargs", k, "keyword names (Python identifiers)")
        self.overlong_buffer.validate()


@dataclass
class RolloutConfig:
    """``rollout``: the generation engine, sampling and shard sealing of each rollout job."""

    engine: str = "transformers"
    """Generation engine: a name of ``config/registries.py:ENGINES`` (the reference lists each with what it is)."""
    device: str = "auto"
    """``auto`` (cuda when the rollout job sees a GPU, else cpu), ``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """Engine weights and activations: ``auto`` (``bfloat16`` on cuda, ``float32`` on cpu), ``float32``,
    ``bfloat16`` or ``float16`` (the trainer's log-probs are fp32; bf16 sampling shows up as importance
    weights != 1 at lag 0)."""
    gpu_memory_utilization: Optional[float] = None
    """vLLM: share of the GPU's memory for weights and KV cache (on CPU: share of host memory for
    the KV cache). null = 0.5 on cuda (room for a trainer on the same GPU is the user's call); on cpu a KV cache of
    twice what the engine can hold in flight (``max_num_seqs`` x ``max_model_len`` tokens), at most 0.1 of host
    memory."""
    max_model_len: Optional[int] = None
    """vLLM: longest prompt + response (null = the model's own limit)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per engine replica."""
    data_parallel_size: int = 1
    """vLLM: engine replicas in the job (vLLM's own data parallelism and load balancing);
    the job needs tensor_parallel_size * data_parallel_size GPUs."""
    enforce_eager: bool = True
    """vLLM: no CUDA graphs / torch.compile (faster start, slower decode; false for long runs)."""
    max_num_seqs: int = 256
    """vLLM: sequences decoded together at most."""
    n: int = 8
    """Responses per prompt (the group size GRPO normalises over)."""
    total_rollout_steps: int = 1200
    """Groups the trainer trains on in the whole run (verl: total prompts).
    The trainer makes total_rollout_steps // R local updates."""
    response_length: int = 8
    """Max new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are those of the tempered distribution)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    max_concurrent_groups: Union[int, str] = "auto"
    """Groups a rollout job generates at once at most (one thread each): a number, or ``auto``: as many as its
    engine decodes together (``ceil(max_num_seqs / n)``), never more than the admission budget B. An upper bound:
    how many a job really has in flight follows from the budget and the fleet (``budget_share``)."""
    budget_share: str = "load"
    """How the rollout jobs share a version's admission budget: ``load`` (each live job up to an even share of
    what the budget lets the fleet have in flight, re-derived at every start as jobs join and leave and versions
    land: no engine idles while another holds the budget) or ``first_come`` (a job takes up to
    max_concurrent_groups whenever it asks: the rule of hpcrl before the share, kept to compare with)."""
    seal_groups: int = 4
    """A shard is sealed (committed) once it holds this many groups ..."""
    seal_interval_s: float = 1.0
    """... or when its oldest group has waited this long, or when the job idles."""
    torch_threads: int = 1
    """torch intra-op threads in the rollout job."""

    def dtype_on(self, device: str) -> str:
        """The engine's dtype on ``device`` (``cpu`` or ``cuda``: ``auto``'s rule)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device == "cuda" else "float32"

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("rollout.engine", self.engine, registries.ENGINES)
        check_choice("rollout.device", self.device, names.ROLLOUT_DEVICES)
        check_choice("rollout.dtype", self.dtype, names.DTYPES)
        if self.gpu_memory_utilization is not None:
            check_float("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        if self.max_model_len is not None:
            check_int("rollout.max_model_len", self.max_model_len, 2)
        check_int("rollout.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("rollout.data_parallel_size", self.data_parallel_size, 1)
        check_int("rollout.max_num_seqs", self.max_num_seqs, 1)
        spec = registries.ENGINES.get(self.engine)
        if spec is not None and not spec.parallel and (self.tensor_parallel_size, self.data_parallel_size) != (1, 1):
            parallel = " or ".join(n for n, s in registries.ENGINES.items() if s.parallel)
            fail("rollout.tensor_parallel_size", (self.tensor_parallel_size, self.data_parallel_size),
                 f"1 and 1 with rollout.engine={self.engine} (it runs one replica on one device)",
                 f"set rollout.engine={parallel} for parallel engines")
        check_int("rollout.n", self.n, 1)
        check_int("rollout.total_rollout_steps", self.total_rollout_steps, 1)
        check_int("rollout.response_length", self.response_length, 1)
        check_float("rollout.temperature", self.temperature, 0.0, lo_open=True)
        check_float("rollout.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.max_concurrent_groups != "auto" and (isinstance(self.max_concurrent_groups, bool) or not isinstance(
                self.max_concurrent_groups, int) or self.max_concurrent_groups < 1):
            fail("rollout.max_concurrent_groups", self.max_concurrent_groups, "an integer >= 1 or auto")
        check_choice("rollout.budget_share", self.budget_share, names.BUDGET_SHARES)
        check_int("rollout.seal_groups", self.seal_groups, 1)
        check_float("rollout.seal_interval_s", self.seal_interval_s, 0.0, lo_open=True)
        check_int("rollout.torch_threads", self.torch_threads, 1)


@dataclass
class AgentConfig:
    """``agent``: how a trajectory is generated: one response (``single_turn``) or a multi-turn
    tool agent (``tool_agent``: generate, call tools, append their answers, generate again).
    A data row's ``agent_name`` column picks the loop for that prompt; ``default`` the rest."""

    default: str = "single_turn"
    """``single_turn`` or ``tool_agent`` for rows without an ``agent_name``."""
    tools: list = field(default_factory=list)
    """Tools the tool agent may call, e.g. ``[{name: calculator}, {name: python, cpu_s: 2}]``
    (hpcrl/rollout/tools.py lists each tool's limits; checked at launch)."""
    tool_parser: str = "hermes"
    """How calls are read from the model's text: ``hermes`` (``<tool_call>{json}</tool_call>``,
    Qwen's format) or ``tiny`` (the built-in tiny model's ``( ... )``)."""
    max_assistant_turns: int = 5
    """Model turns per trajectory at most; a call asked for in the last one is not run."""
    max_user_turns: int = 5
    """Tool-response turns per trajectory at most."""
    max_parallel_calls: int = 1
    """Calls of one turn that are run (at once); further calls in the turn are ignored."""
    max_tool_response_chars: int = 256
    """Characters (not tokens) of a tool's answer shown to the model; the rest is cut."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("agent.default", self.default, registries.AGENT_LOOPS)
        check_choice("agent.tool_parser", self.tool_parser, registries.TOOL_PARSERS)
        for key in ("max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_chars"):
            check_int(f"agent.{key}", getattr(self, key), 1)
        if self.default == "tool_agent" and not self.tools:
            fail("agent.tools", self.tools, "at least one tool with agent.default=tool_agent",
                 "e.g. agent.tools=[{name: calculator}]")


@dataclass
class AsyncConfig:
    """``async_training``: verl's fully-async knobs (s, K, require_batches) and the log-prob anchors."""

    staleness_threshold: float = 0.0
    """s: per weight version the rollout fleet starts at most floor((1+s)*K*R)
    groups, counting carry-over. 0 = no stale samples."""
    require_batches: int = 1
    """Mini-batches per local update: R = ppo_mini_batch_size * require_batches groups."""
    trigger_parameter_sync_step: int = 1
    """K: local updates between two published weight versions."""
    partial_rollout: bool = False
    """At a version change, stop in-flight generation within about one decoding step and
    continue each unfinished response under the new weights (every token keeps the version
    that sampled it) instead of waiting for the slowest group. Needs staleness_threshold > 0
    (at s = 0 no group is in flight at a version change)."""
    use_rollout_log_probs: bool = True
    """PPO anchor = the engine's log-probs of the sampled tokens (true, "bypass") or
    the trainer's own log-probs at the start of the update (false)."""
    compute_prox_log_prob: bool = False
    """Decoupled PPO: also compute the trainer's log-probs at the start of each local
    update (the proximal policy) and use them as the PPO anchor, while the engine's
    log-probs stay the behaviour policy of the importance weights
    (algorithm.rollout_correction). Implied by use_rollout_log_probs=false."""
    max_staleness: Optional[int] = None
    """Hard cap on lag in versions: older groups are dropped and counted (null = off)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_float("async_training.staleness_threshold", self.staleness_threshold, 0.0)
        check_int("async_training.require_batches", self.require_batches, 1)
        check_int("async_training.trigger_parameter_sync_step", self.trigger_parameter_sync_step, 1)
        check_choice("async_training.partial_rollout", self.partial_rollout, (True, False))
        if self.partial_rollout and self.staleness_threshold == 0:
            fail("async_training.partial_rollout", True, "false while async_training.staleness_threshold is 0 "
                 "(no group is in flight at a version change)", "set async_training.staleness_threshold > 0")
        check_choice("async_training.use_rollout_log_probs", self.use_rollout_log_probs, (True, False))
        check_choice("async_training.compute_prox_log_prob", self.compute_prox_log_prob, (True, False))
        if self.max_staleness is not None:
            check_int("async_training.max_staleness", self.max_staleness, 0)


@dataclass
class TrainerConfig:
    """``trainer``: checkpoint cadence and threads of the trainer job."""

    checkpoint_every_updates: int = 20
    """Save model, optimizer and sample cursor together every this many local updates."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    keep_consumed_shards: int = 8
    """Per rollout writer, the shard files wholly behind the checkpointed sample cursor that stay on disk (the
    newest ones: ``hpcrl samples`` reads them); older ones are deleted after each checkpoint (their manifest lines,
    the record of what was committed, stay). -1 keeps every shard."""
    torch_threads: int = 1
    """torch intra-op threads per trainer rank."""
    simulated: bool = False
    """Replace each update's computation by a sleep of ``simulated.update_base_s + simulated.update_per_token_s *
    tokens / simulated.trainer_gpus`` (modelled seconds); everything else (samples, admission, publishing the
    tiny model's weights, checkpoints) is real. Needs ``rollout.engine=simulated``."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("trainer.simulated", self.simulated, (True, False))
        check_int("trainer.checkpoint_every_updates", self.checkpoint_every_updates, 1)
        check_int("trainer.keep_checkpoints", self.keep_checkpoints, 1)
        check_int("trainer.keep_consumed_shards", self.keep_consumed_shards, -1)
        check_int("trainer.torch_threads", self.torch_threads, 1)


@dataclass
class WeightsConfig:
    """``weights``: how versions reach the rollout jobs, and how many are kept."""

    transport: str = "filesystem"
    """How weights reach rollout jobs, a name of ``config/registries.py:WEIGHT_TRANSPORTS`` (the reference lists each
    with what it is). Every version is always written as a safetensors folder in RUN/weights (late joiners,
    restarts, retention); a transport is a faster copy beside it, and one that fails later (a dead peer, a timeout)
    falls back to the files for that version."""
    bucket_mib: float = 64.0
    """Broadcast bucket size in MiB (2**20 bytes; two buckets in flight on the trainer; larger = fewer messages)."""
    broadcast_backend: str = "auto"
    """The broadcast group's backend: ``gloo`` (through host memory; CPU runs, and vLLM, whose workers map the
    received bytes from shared memory), ``nccl`` (GPU to GPU: the trainer and every rollout job need GPUs, and
    the rollout engine must hold its weights on its GPU: the transformers engine on cuda), or ``auto`` (nccl
    when both ends hold CUDA tensors, gloo otherwise)."""
    keep_versions: int = 3
    """Newest versions always kept; older ones are deleted unless a live rollout
    job has announced it is loading them (or a kept delta version is written against them)."""
    delta: bool = True
    """Write a version as its changes against the newest full version (per tensor the XOR of its bits with the
    base's, zstd-compressed: ``weights/vN/model.delta``) where that pays: at RL learning rates a few per cent
    of the bf16 values change per version, so the trainer writes and every rollout job reads a fraction of the
    model. Readers keep the base in host memory, rebuild each version and check every tensor against the
    trainer's hash. A version is full when ``full_every`` versions have passed since the base, when the delta
    would exceed ``delta_max_ratio`` of the full size (fp32 weights at a high learning rate), and at a
    trainer's first publish. A delta version's folder is not a loadable model: ``hpcrl export`` rebuilds it.
    false: every version is a full safetensors folder."""
    full_every: int = 10
    """With ``delta``: a full version at least every this many versions (1: every version full). Larger
    means fewer full writes, but each delta is counted from an older base and grows."""
    delta_max_ratio: float = 0.5
    """With ``delta``: a version whose delta would be larger than this share of the full size is written full
    (and becomes the new base)."""

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_choice("weights.transport", self.transport, registries.WEIGHT_TRANSPORTS)
        check_int("weights.keep_versions", self.keep_versions, 2)
        check_choice("weights.delta", self.delta, (True, False))
        check_int("weights.full_every", self.full_every, 1)
        check_float("weights.delta_max_ratio", self.delta_max_ratio, 0.0, 1.0, lo_open=True)
        check_float("weights.bucket_mib", self.bucket_mib, 0.0, 4096.0, lo_open=True)
        check_choice("weights.broadcast_backend", self.broadcast_backend, names.BROADCAST_BACKENDS)
