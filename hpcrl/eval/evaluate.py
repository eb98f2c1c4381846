"""Evaluate the model an engine holds on the held-out prompts: generate, score, compute verl's metrics.

The same code serves the evaluation job and ``hpcrl eval``. Generation goes through the rollout job's agent
loops (``run_group``: single-turn or the tool agent, by the row's ``agent_name``) on one engine; up to
``eval.concurrent_prompts`` prompts at once, each in a thread of its own (vLLM batches their requests).
Scoring is the rollout job's reward scorer, keeping what a dict-valued reward returns besides its score
(``acc``, ``pred``, ...): the metrics (``metrics.py``) need it. Between prompts the caller's ``check`` runs
(SIGTERM, USR2): the version is then abandoned; nothing of it has been written.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Optional

from hpcrl.config import RunConfig
from hpcrl.eval import metrics
from hpcrl.eval.data import response_length
from hpcrl.logs.eval_log import EvalSample, finite_metrics
from hpcrl.process import faults
from hpcrl.rollout.agent_loop import AgentLoop, GroupContext, group_seed, run_group
from hpcrl.rollout.engine import FINISH_LENGTH, Engine, EngineRunner
from hpcrl.rollout.gate import EngineGate
from hpcrl.rollout.loops import loop_name
from hpcrl.rollout.reward_fn import RewardScorer
from hpcrl.rollout.trajectory import TrajectoryState
from hpcrl.weights import WeightVersion

log = logging.getLogger("hpcrl.eval")


@dataclass
class Evaluation:
    """What evaluating one version (or model folder) gave."""

    samples: list[EvalSample]
    """Every response, prompt by prompt."""
    metrics: dict[str, float]
    """verl's ``val-core``/``val-aux`` metrics and the response lengths (``metrics.py``)."""
    score: Optional[float]
    score_name: str
    eval_s: float
    """Seconds to generate and score."""


def summarize(samples: list[EvalSample]) -> tuple[dict[str, float], Optional[float], str]:
    """(metrics, headline score, its name) of a version's samples (``metrics.py``): each sample's ``reward`` and
    every field its reward returned are keys; a key a sample lacks is None there."""
    keys = sorted({k for s in samples for k in s.extras} - {"reward"})
    infos = {"reward": [s.reward for s in samples], **{k: [s.extras.get(k) for s in samples] for k in keys}}
    sources = [s.data_source for s in samples]
    nested = metrics.validation_metrics(sources, [s.prompt_id for s in samples], infos)
    out = metrics.metric_names(nested)
    out.update(metrics.response_metrics(sources, [s.response_tokens for s in samples],
                                        [s.finish_reason == FINISH_LENGTH for s in samples],
                                        [s.num_turns for s in samples]))
    score, name = metrics.headline(nested)
    return finite_metrics(out), score, name


class Evaluator:
    """The held-out prompts, their reward, the agent loops and one engine (module docstring)."""

    def __init__(self, cfg: RunConfig, tokenizer, rows: list[dict], scorer: RewardScorer,
                 loops: dict[str, AgentLoop], runner: EngineRunner, engine: Engine, source: str):
        self.cfg, self.tokenizer, self.rows, self.scorer = cfg, tokenizer, rows, scorer
        self.loops, self.runner, self.engine, self.source = loops, runner, engine, source
        self.gate = EngineGate()
        """Open while a version is evaluated; stopped when the job stops (threads then abandon their prompt)."""
        self.pool = ThreadPoolExecutor(cfg.eval.concurrent_prompts, thread_name_prefix="eval-prompt")

    def load(self, wv: WeightVersion) -> float:
        """Hand a verified version to the engine; the seconds it took (an engine error is raised)."""
        t0 = time.monotonic()
        self.runner.call(lambda: self.engine.load_weights(wv), self.cfg.timeouts.generate_s,
                         f"loading weight version {wv.version} ({wv.folder}) into the evaluation engine")
        return time.monotonic() - t0

    def evaluate(self, version: int, check: Callable[[], None] = lambda: None,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> Evaluation:
        """Every held-out prompt's n responses with the engine's weights (call them ``version``), scored, and the
        metrics. ``check()`` runs between prompts and may raise to abandon the version."""
        t0 = time.monotonic()
        self.gate.open(version)
        todo = list(enumerate(self.rows))
        todo.reverse()
        in_flight: dict[Future, int] = {}
        results: dict[int, list[EvalSample]] = {}
        while todo or in_flight:
            check()
            while todo and len(in_flight) < self.cfg.eval.concurrent_prompts:
                i, row = todo.pop()
                faults.point("eval_prompt")
                in_flight[self.pool.submit(self._prompt, version, i, row)] = i
            done, _ = wait(list(in_flight), timeout=self.cfg.timeouts.poll_interval_s * 10, return_when=FIRST_COMPLETED)
            for fut in done:
                results[in_flight.pop(fut)] = fut.result()  # an error in generation stops the job, loudly
                progress(len(results), len(self.rows))
        samples = [s for i in sorted(results) for s in results[i]]
        values, score, name = summarize(samples)
        return Evaluation(samples, values, score, name, time.monotonic() - t0)

    def _prompt(self, version: int, i: int, row: dict) -> list[EvalSample]:
        """The n responses to held-out prompt ``i``, scored (runs in a pool thread)."""
        loop = self.loops[loop_name(row, self.cfg.agent)]
        trajs = [TrajectoryState() for _ in range(self.cfg.eval.n)]
        ctx = GroupContext(self.engine, self.gate, list(row["prompt_ids"]), group_seed(self.cfg.data.seed, i),
                           response_length(self.cfg))
        run_group(loop, ctx, trajs, self.runner, self.cfg.timeouts.generate_s,
                  f"evaluating held-out prompt {row['prompt_id']} with version {version}")
        prompt = self.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
        texts = [self.tokenizer.decode(t.tokens, skip_special_tokens=True) for t in trajs]
        scored = self.scorer.score_group([f"eval/v{version}/{row['prompt_id']}/{j}" for j in range(len(trajs))], row,
                                         [(t.tokens, text) for t, text in zip(trajs, texts)],
                                         [loop.reward_info(t) for t in trajs], stop=lambda: self.gate.stopping)
        out = []
        for j, t in enumerate(trajs):
            text, (reward, extras) = texts[j], scored[j]
            out.append(EvalSample(version=version, prompt_id=row["prompt_id"], data_source=row["data_source"],
                                  index=j, prompt=prompt, response=text, ground_truth=row["answer"], reward=reward,
                                  extras=extras, response_tokens=int(sum(t.mask)), finish_reason=t.finish_reason or "",
                                  num_turns=t.num_turns, source=self.source))
        return out

    def abandon(self) -> None:
        """Stop the prompts in flight (their threads end at the gate; the engine's generations are aborted)."""
        self.gate.stop()
        try:
            self.runner.call(self.engine.abort_all, 60.0, "aborting the evaluation's generations")
        except Exception as e:  # noqa: BLE001 - shutting down: say so and go on
            log.warning("could not abort the evaluation engine's generations: %s", e)
        self.pool.shutdown(wait=True, cancel_futures=True)
