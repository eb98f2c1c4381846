"""What a rollout or evaluation job holds to score with the reward model: :class:`ModelRewards`.

Where the model runs is the backend: the reward jobs (:class:`~hpcrl.reward.client.RewardClient`,
``reward_model.placement: job``) or the model in this process (:class:`LocalBackend`, ``placement: rollout``; a
discriminative model's calls from the job's group threads are batched together as a reward job batches its
clients'). Either way a group is one request: all its responses go together as soon as the group has finished
generating, in the group's own thread, while the engine goes on with the other groups.

What the reward becomes (verl's rule, ``rollout/reward_fn.py``): without ``reward.path`` the model's score; with it,
your function, which may take ``rm_score`` (this response's score, fetched with the group's request) and
``reward_model`` (a :class:`RewardModelHandle` for calls of its own: a judge's ``generate``, a ``score`` of another
text), combining them with rules as it likes (verl's hybrid rewards).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol

from hpcrl.logs import metric_names as M
from hpcrl.reward.client import RewardClient
from hpcrl.reward.models import RewardModel, load_reward_model
from hpcrl.reward.server import Batcher, ServerStats
from hpcrl.reward.wire import ScoreItem, Scored
from hpcrl.rundir.paths import RunDir

log = logging.getLogger("hpcrl.reward")

Stop = Callable[[], bool]


class Backend(Protocol):
    """Where the reward model runs, as the scorers see it."""

    def score(self, items: list[ScoreItem], what: str, stop: Stop) -> list[Scored]:
        """One result per item."""

    def generate(self, prompts: list[Any], max_new_tokens: Optional[int], greedy: bool, what: str,
                 stop: Stop) -> list[str]:
        """A judge's answers to free prompts."""

    def close(self) -> None:
        """Release it."""


class LocalBackend:
    """The reward model in this process (``reward_model.placement: rollout``)."""

    def __init__(self, model: RewardModel):
        self.model = model
        self.stats = ServerStats()
        self.batcher = Batcher(model, self.stats) if model.batched else None

    def score(self, items: list[ScoreItem], what: str, stop: Stop) -> list[Scored]:
        if self.batcher is not None:
            return self.batcher.submit(items).result()
        return self.model.score(items)

    def generate(self, prompts: list[Any], max_new_tokens: Optional[int], greedy: bool, what: str,
                 stop: Stop) -> list[str]:
        return self.model.generate(prompts, max_new_tokens, greedy)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.model.close()


class RewardModelHandle:
    """What a hybrid reward function gets as ``reward_model``: the model, bound to the row being scored."""

    def __init__(self, backend: Backend, tokenizer, row: dict, stop: Stop):
        self._backend, self._tokenizer, self._row, self._stop = backend, tokenizer, row, stop

    def score(self, response: str) -> Optional[float]:
        """The model's score of ``response`` as an answer to this row's prompt (None: it has none)."""
        ids = list(self._tokenizer(response, add_special_tokens=False)["input_ids"])
        item = ScoreItem(prompt=self._row["prompt"], prompt_ids=list(self._row["prompt_ids"]), response_ids=ids,
                         response=response, ground_truth=self._row["answer"], data_source=self._row["data_source"])
        return self._backend.score([item], "a reward function's own score call", self._stop)[0].score

    def generate(self, prompt: Any, max_new_tokens: Optional[int] = None, greedy: bool = True) -> str:
        """A generative judge's answer to ``prompt`` (a string or chat messages), through its chat template."""
        return self._backend.generate([prompt], max_new_tokens, greedy, "a reward function's own judge call",
                                      self._stop)[0]


class ModelRewards:
    """The reward model as a job's scorer uses it (module docstring); counts what it did for the version rows."""

    def __init__(self, backend: Backend, tokenizer):
        self.backend, self.tokenizer = backend, tokenizer
        self._lock = threading.Lock()
        self._groups, self._seconds, self._problems, self._first_problem = 0, 0.0, 0, ""

    def group_scores(self, row: dict, responses: list[tuple[list[int], str]], what: str,
                     stop: Stop) -> list[Optional[float]]:
        """The model's score of each ``(tokens, text)`` response to ``row`` in one request (None where it has none,
        counted); :class:`~hpcrl.reward.wire.RewardUnavailable` if no reward job answers."""
        items = [ScoreItem(prompt=row["prompt"], prompt_ids=list(row["prompt_ids"]), response_ids=list(ids),
                           response=text, ground_truth=row["answer"], data_source=row["data_source"])
                 for ids, text in responses]
        t0 = time.monotonic()
        scored = self.backend.score(items, what, stop)
        with self._lock:
            self._groups += 1
            self._seconds += time.monotonic() - t0
            for s in scored:
                if s.score is None:
                    self._problems += 1
                    self._first_problem = self._first_problem or f"{what}: {s.problem}"[:300]
        return [s.score for s in scored]

    def handle(self, row: dict, stop: Stop) -> RewardModelHandle:
        """The ``reward_model`` argument of a hybrid function scoring a response to ``row``."""
        return RewardModelHandle(self.backend, self.tokenizer, row, stop)

    def pop_metrics(self) -> dict[str, Any]:
        """``timing_s/reward`` (seconds groups waited for the model, summed), the mean per group, and the responses
        without a score (the first one's reason) since the last call."""
        with self._lock:
            out: dict[str, Any] = {M.TIMING_REWARD: self._seconds, M.REWARD_MODEL_GROUPS: self._groups,
                                   M.REWARD_MODEL_S_PER_GROUP: self._seconds / self._groups if self._groups else 0.0,
                                   M.REWARD_MODEL_PROBLEMS: self._problems}
            if self._first_problem:
                out[M.REWARD_MODEL_FIRST_PROBLEM] = self._first_problem
            retries = getattr(self.backend, "retries", None)
            if retries is not None:
                out[M.REWARD_MODEL_RETRIES] = retries
            self._groups, self._seconds, self._problems, self._first_problem = 0, 0.0, 0, ""
        return out

    def close(self) -> None:
        """Release the backend (a local model, the client's connections)."""
        self.backend.close()


def eval_scores_with_model(cfg) -> bool:
    """The evaluation's reward uses the reward model: its reward is the training one, or a function of its own
    (which may take the model); a built-in rule of ``eval.reward.name`` does not."""
    return cfg.reward_model.enable and not (cfg.eval.reward.name and not cfg.eval.reward.path)


def model_rewards(cfg, run_dir: RunDir, job: str, tokenizer, local: bool = False) -> ModelRewards:
    """The reward model for job ``job`` of the run: the reward jobs' client (``reward_model.placement: job``), or
    the model loaded in this process (``rollout``, or ``local``: ``hpcrl eval`` of a run)."""
    rm, t = cfg.reward_model, cfg.timeouts
    if rm.placement == "job" and not local:
        return ModelRewards(RewardClient(run_dir, job, rm.request_timeout_s, rm.wait_s, t.wait_log_interval_s),
                            tokenizer)
    model = load_reward_model(cfg, run_dir.reward_model_dir(rm.path), tokenizer)
    log.info("the reward model in this job: %s", model.describe())
    return ModelRewards(LocalBackend(model), tokenizer)
