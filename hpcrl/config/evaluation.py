"""Config section of the evaluation job (``eval``): which weight versions it evaluates, how it samples,
with which engine and reward. The held-out prompts are ``data.val_files``; the job's size is
``resources.eval``. verl's names map here (:data:`hpcrl.config.verl_keys.VERL_KEYS`): ``trainer.test_freq``
-> ``every_versions``, ``trainer.val_before_train`` -> ``before_training``,
``actor_rollout_ref.rollout.val_kwargs.*`` -> ``n``, ``do_sample``, ``temperature``, ``top_p``, ``top_k``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from hpcrl.config import registries
from hpcrl.config.checks import check_choice, check_float, check_int, fail
from hpcrl.config.sections import RewardConfig


@dataclass
class EvalRewardConfig:
    """``eval.reward``: how the evaluation scores a response. With ``name`` and ``path`` both null (the
    default) it is the training reward (``reward.*``); otherwise ``path`` (a file, with ``function``) or,
    if ``path`` is null, the built-in ``name``."""

    name: Optional[str] = None
    """A built-in reward (:func:`hpcrl.config.registries.reward_names`) for the evaluation; null = see above."""
    path: Optional[str] = None
    """A Python file with the evaluation's reward function (verl's signature); null = see above."""
    function: str = "compute_score"
    """The function's name in ``path``."""

    def resolve(self, training: RewardConfig) -> RewardConfig:
        """The reward the evaluation uses, given the training's."""
        if self.name is None and self.path is None:
            return training
        return replace(training, name=self.name or training.name, path=self.path, function=self.function)

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        if self.name is not None:
            check_choice("eval.reward.name", self.name, registries.reward_names())
        if self.path is not None and Path(self.path).suffix != ".py":
            fail("eval.reward.path", self.path, "null or a .py file", "point eval.reward.path at your reward file")
        if not isinstance(self.function, str) or not self.function.isidentifier():
            fail("eval.reward.function", self.function, "a Python function name")


@dataclass
class EvalConfig:
    """``eval``: the evaluation job, a reader of the published weight versions on its own allocation
    (``hpcrl/eval/``). It evaluates version 0 (``before_training``), every ``every_versions``-th version and
    the final one on ``data.val_files``, and writes ``logs/eval.jsonl`` with verl's validation metrics."""

    every_versions: int = 0
    """Evaluate every this many weight versions (v20, v40, ... for 20) and the final one; 0 = no evaluation
    job (verl: ``trainer.test_freq``, whose -1 also means off). With K > 1 a version is published every K
    updates, so versions, not updates, are counted."""
    before_training: bool = True
    """Also evaluate version 0, the model before any update (verl: ``trainer.val_before_train``)."""
    n: int = 1
    """Responses per held-out prompt (verl: ``val_kwargs.n``); best@k, worst@k and maj@k need n > 1."""
    do_sample: bool = False
    """false: greedy decoding (verl's default); true: sample with temperature, top_p and top_k."""
    temperature: float = 1.0
    """Sampling temperature when ``do_sample`` (verl: ``val_kwargs.temperature``; must then be > 0)."""
    top_p: float = 1.0
    """Nucleus sampling threshold when ``do_sample`` (1.0 = off)."""
    top_k: int = -1
    """Sample among the k most likely tokens when ``do_sample``; -1 or 0 = off (verl: -1 for vLLM, 0 for HF)."""
    max_prompts: Optional[int] = None
    """Evaluate at most this many prompts of ``data.val_files`` (a fixed, seeded subset, the same for every
    version); null = all."""
    response_length: Optional[int] = None
    """Max new tokens per response; null = ``rollout.response_length``."""
    engine: Optional[str] = None
    """``transformers`` or ``vllm``; null = ``rollout.engine``. The other engine options (device, dtype, vLLM's
    memory share, ...) are ``rollout.*``'s."""
    concurrent_prompts: int = 8
    """Prompts generated at once (vLLM batches their requests; each is one thread)."""
    keep_samples_versions: int = 10
    """Keep the responses (``logs/eval_samples.jsonl.gz``) of this many newest evaluated versions; older ones
    are released from the file's head (their rows and metrics in ``logs/eval.jsonl`` stay). -1 keeps all. Where
    the filesystem cannot release part of a file (no ``fallocate`` hole punching), all are kept (one log line)."""
    reward: EvalRewardConfig = field(default_factory=EvalRewardConfig)
    """The evaluation's reward; the training reward unless set."""

    @property
    def enabled(self) -> bool:
        """The run has an evaluation job."""
        return self.every_versions > 0

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_int("eval.every_versions", self.every_versions, -1)
        check_choice("eval.before_training", self.before_training, (True, False))
        check_int("eval.n", self.n, 1)
        check_choice("eval.do_sample", self.do_sample, (True, False))
        check_float("eval.temperature", self.temperature, 0.0)
        check_float("eval.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("eval.top_k", self.top_k, -1)
        if self.max_prompts is not None:
            check_int("eval.max_prompts", self.max_prompts, 1)
        if self.response_length is not None:
            check_int("eval.response_length", self.response_length, 1)
        if self.engine is not None:
            check_choice("eval.engine", self.engine, registries.ENGINES)
        check_int("eval.concurrent_prompts", self.concurrent_prompts, 1)
        if self.keep_samples_versions != -1:
            check_int("eval.keep_samples_versions", self.keep_samples_versions, 1)
        self.reward.validate()
        if self.do_sample and self.temperature <= 0:
            fail("eval.temperature", self.temperature, "a number > 0 with eval.do_sample=true",
                 "set eval.temperature (e.g. 1.0), or eval.do_sample=false for greedy decoding")
        if not self.do_sample and self.n > 1:
            fail("eval.n", self.n, "1 with greedy decoding (eval.do_sample=false: every response would be the "
                 "same)", "set eval.do_sample=true (with eval.temperature) to sample n responses, or eval.n=1")
