"""Config section of a learned reward (``reward_model``): which model scores the responses, where it runs and how
a response becomes its input. The reward jobs' sizes are ``resources.reward`` and ``resources.reward_jobs``.

verl's keys map here (:data:`hpcrl.config.verl_keys.VERL_KEYS`): 0.9.1's ``reward.reward_model.*`` and the older
top-level ``reward_model.*`` (``enable``, ``model.path`` / ``model_path``, ``micro_batch_size_per_gpu``,
``max_length``, ``rollout.*``), each read as it is or refused with the reason. What the model's score becomes is
verl's rule: with ``reward.path`` your function is the reward (it may take the model's score, ``rm_score``, and a
client, ``reward_model``: the hybrid); without it the reward is the model's score (hpcrl/reward/, docs/reward-models.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpcrl.config import names, registries
from hpcrl.config.checks import check_choice, check_float, check_int, fail, reported

DEFAULT_JUDGE_TEMPLATE = "{prompt} {response} ?"
"""The generative judge's default prompt: the question, the response and a question mark (the tiny vocabulary
has these words); a real judge wants its own instructions (``reward_model.prompt_template``)."""


@dataclass
class RewardModelConfig:
    """``reward_model``: a learned reward, a discriminative model (an HF sequence classifier: the score at the last
    token of prompt + response) or a generative judge (a causal LM: a prompt template, a generated verdict, a score
    parser). Served by reward jobs of their own (``placement: job``) or inside each rollout job (``rollout``)."""

    enable: bool = False
    """Score responses with the model (verl: ``reward_model.enable``, 0.9.1: ``reward.reward_model.enable``)."""
    path: Optional[str] = None
    """A local HF model folder (verl: ``reward_model.model.path``, 0.9.1: ``reward.reward_model.model_path``), or
    ``builtin:tiny-rm`` (a tiny sequence classifier trained at launch to predict the toy task's rule reward) /
    ``builtin:tiny-judge`` (a random tiny causal LM), built into ``RUN/reward_model`` like the tiny model."""
    kind: str = "auto"
    """``discriminative``, ``generative`` or ``auto``: from the folder's ``config.json`` (an architecture ending in
    ``ForSequenceClassification`` is discriminative, one ending in ``ForCausalLM`` generative)."""
    placement: str = "job"
    """``job``: ``resources.reward_jobs`` reward jobs on their own allocations serve every rollout job (verl's
    standalone pool, ``enable_resource_pool: true``); ``rollout``: each rollout job (and the evaluation job) loads
    the model itself, for a small one (verl's colocated mode)."""
    engine: str = "auto"
    """The generative judge's engine (a :data:`hpcrl.config.registries.ENGINES` name; verl:
    ``reward_model.rollout.name``); ``auto``: the rollout job's (``rollout.engine``). A discriminative model always
    runs a transformers forward."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda where the job sees a GPU)."""
    dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float16`` or ``auto`` (bfloat16 on cuda, float32 on cpu; verl:
    ``reward_model.rollout.dtype``)."""
    micro_batch_size: int = 16
    """A discriminative model's sequences per forward (verl: ``reward_model.micro_batch_size_per_gpu``): requests
    of several rollout jobs are batched together up to this."""
    max_batch_tokens: Optional[int] = None
    """Padded tokens per forward at most (verl: ``reward_model.forward_max_token_len_per_gpu``); null: no limit
    beyond ``micro_batch_size``."""
    max_length: Optional[int] = None
    """Longest model input in tokens (verl: ``reward_model.max_length``, or ``reward_model.rollout.prompt_length``);
    null: the model's ``max_position_embeddings``. A longer one is cut by ``truncation``."""
    truncation: str = "left"
    """An input over ``max_length``: cut on the ``left`` (the response's end, where a discriminative model's score
    is read, stays), on the ``right``, or an ``error`` (that response's reward is 0, counted as a reward error)."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The generative judge's prompt, a Python format string with ``{prompt}`` (the question as text),
    ``{response}`` and ``{ground_truth}``; sent as one user message through the judge's chat template when it has
    one (generation prompt added)."""
    score_parser: str = "last_number"
    """How the judge's text becomes a score: a built-in (:data:`hpcrl.config.registries.SCORE_PARSERS`) or your
    own function ``FILE.py:NAME`` taking the text and returning a number (None, or an exception: reward 0,
    counted)."""
    max_new_tokens: int = 32
    """Longest verdict the judge generates (verl: ``reward_model.rollout.response_length``)."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, so the same response always gets the same score)."""
    top_p: float = 1.0
    """The judge's top-p."""
    seed: int = 0
    """The judge's sampling seed (each request's is derived from it and the response)."""
    gpu_memory_utilization: Optional[float] = None
    """vLLM judge: share of GPU memory (verl: ``reward_model.rollout.gpu_memory_utilization``); null: vLLM's
    default for the device."""
    tensor_parallel_size: int = 1
    """vLLM judge: GPUs per engine (verl: ``reward_model.rollout.tensor_model_parallel_size``)."""
    max_num_seqs: int = 256
    """vLLM judge: sequences batched at once (verl: ``reward_model.rollout.max_num_seqs``)."""
    trust_remote_code: bool = False
    """Load a model folder whose architecture is code in the folder (verl: ``reward_model.model.trust_remote_code``)."""
    torch_threads: int = 1
    """CPU threads of the model's forward in a reward job (``torch.set_num_threads``)."""
    request_timeout_s: float = 120.0
    """One scoring request's deadline at a reward job; a request past it (or a connection lost) is sent again,
    to the least loaded reward job, and the reply that comes first is the one kept."""
    wait_s: float = 900.0
    """How long a rollout or evaluation job waits for any reward job to answer (none up yet, all restarting) before
    it fails, naming the reward jobs and their heartbeats; a reward job that cannot load the model stops the run
    at once instead (``control/fatal.json``)."""
    scoring_groups: Optional[int] = None
    """Groups a rollout job may have waiting for their rewards beyond the ``rollout.max_concurrent_groups`` it
    generates (the engine never waits for the reward model while these are free); null: as many as it generates."""

    @property
    def builtin(self) -> bool:
        """The model is one of hpcrl's tiny ones, built into the run directory at launch."""
        return self.path in names.BUILTIN_REWARD_MODELS

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        if not isinstance(self.enable, bool):
            fail("reward_model.enable", self.enable, "true or false")
        if self.enable and (not isinstance(self.path, str) or not self.path.strip()):
            fail("reward_model.path", self.path, f"a local HF model folder or one of "
                 f"{', '.join(names.BUILTIN_REWARD_MODELS)} with reward_model.enable=true",
                 "set reward_model.path (verl: reward_model.model.path)")
        check_choice("reward_model.kind", self.kind, names.REWARD_MODEL_KINDS)
        check_choice("reward_model.placement", self.placement, names.REWARD_MODEL_PLACEMENTS)
        check_choice("reward_model.engine", self.engine, ("auto", *(e for e, spec in registries.ENGINES.items()
                                                                    if not spec.simulated)))
        check_choice("reward_model.device", self.device, names.ROLLOUT_DEVICES)
        check_choice("reward_model.dtype", self.dtype, names.DTYPES)
        check_int("reward_model.micro_batch_size", self.micro_batch_size, 1)
        for key in ("max_batch_tokens", "max_length"):
            if getattr(self, key) is not None:
                check_int(f"reward_model.{key}", getattr(self, key), 2)
        check_choice("reward_model.truncation", self.truncation, ("left", "right", "error"))
        self._check_template()
        if not isinstance(self.score_parser, str) or not (self.score_parser in registries.SCORE_PARSERS or (
                ":" in self.score_parser and self.score_parser.rsplit(":", 1)[0].endswith(".py"))):
            fail("reward_model.score_parser", self.score_parser,
                 f"one of {', '.join(registries.SCORE_PARSERS)} or FILE.py:FUNCTION",
                 "name a built-in parser or your own function")
        check_int("reward_model.max_new_tokens", self.max_new_tokens, 1)
        check_float("reward_model.temperature", self.temperature, 0.0)
        check_float("reward_model.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("reward_model.seed", self.seed, 0)
        if self.gpu_memory_utilization is not None:
            check_float("reward_model.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        check_int("reward_model.tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("reward_model.max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.trust_remote_code, bool):
            fail("reward_model.trust_remote_code", self.trust_remote_code, "true or false")
        check_int("reward_model.torch_threads", self.torch_threads, 1)
        check_float("reward_model.request_timeout_s", self.request_timeout_s, 0.0, lo_open=True)
        check_float("reward_model.wait_s", self.wait_s, 0.0, lo_open=True)
        if self.scoring_groups is not None:
            check_int("reward_model.scoring_groups", self.scoring_groups, 0)

    def _check_template(self) -> None:
        if not isinstance(self.prompt_template, str):
            fail("reward_model.prompt_template", self.prompt_template, "a string")
            return
        try:
            self.prompt_template.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as e:
            fail("reward_model.prompt_template", self.prompt_template,
                 "a format string whose only fields are {prompt}, {response} and {ground_truth}",
                 f"fix the field {e} (write a literal brace as {{{{ or }}}})")


def check_reward_model_combination(cfg) -> None:
    """The rules between ``reward_model`` and the other sections (``cfg`` is the RunConfig)."""
    rm = cfg.reward_model
    if not rm.enable or reported("reward_model."):
        return
    if cfg.reward.path is None and cfg.reward.name != names.BY_DATA_SOURCE:
        fail("reward.name", cfg.reward.name, f"{names.BY_DATA_SOURCE} (unused) with reward_model.enable=true and no "
             "reward.path: the reward is the model's score", "to combine the model with a rule, write a reward.path "
             "function that takes rm_score (the model's score) and calls the rule; or set reward_model.enable=false")
    if registries.simulated_engine(cfg.rollout.engine):
        fail("reward_model.enable", True, "false with rollout.engine=simulated (its tokens are made up)",
             "set reward_model.enable=false for a simulated run")
    if rm.placement == "job" and cfg.resources.reward_jobs < 1 and not reported("resources.reward_jobs"):
        fail("resources.reward_jobs", cfg.resources.reward_jobs, ">= 1 with reward_model.placement=job",
             "give the reward model at least one job, or set reward_model.placement=rollout")
    gpus = cfg.resources.reward.gpus_per_node if rm.placement == "job" else cfg.resources.rollout.gpus_per_node
    if rm.device == "cuda" and gpus == 0:
        where = "resources.reward" if rm.placement == "job" else "resources.rollout"
        fail("reward_model.device", "cuda", f"cpu or auto while {where}.gpus_per_node is 0",
             f"set {where}.gpus_per_node to the GPUs the reward model should get")
