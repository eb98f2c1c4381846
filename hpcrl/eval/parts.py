"""What an evaluation builds once: its inputs (tokenizer, held-out prompts, reward, agent loops), its weight
subscriber, and its engine (started by the job only once it holds the first version it will evaluate, so that
version cannot be deleted while a slow engine starts).

The subscriber reads files only, whatever ``weights.transport`` says: the evaluation takes one version in
``eval.every_versions``, and a member of the weight broadcast would make the trainer send it every one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hpcrl.config import RunConfig
from hpcrl.control.startup import StartupSteps
from hpcrl.eval.data import engine_name, eval_engine_options, eval_reward, load_heldout
from hpcrl.eval.evaluate import Evaluator
from hpcrl.process.reaper import start_reaper, stop_reaper
from hpcrl.reward.scoring import eval_scores_with_model
from hpcrl.rollout.agent_loop import AgentLoop
from hpcrl.rollout.engine import EngineRunner
from hpcrl.rollout.engines import make_engine
from hpcrl.rollout.loops import make_loops
from hpcrl.rollout.reward_fn import RewardScorer, load_reward
from hpcrl.rundir.paths import RunDir
from hpcrl.tiny.model import load_tokenizer
from hpcrl.weights import WeightSubscriber, make_subscriber
from hpcrl.weights.adapter import verify_base

log = logging.getLogger("hpcrl.eval")


@dataclass
class EvalInputs:
    """The held-out prompts and how their responses are scored."""

    tokenizer: Any
    rows: list[dict]
    """Held-out prompt rows (``prompt_ids``, ``prompt_id``, ``data_source``, ``answer``, ...)."""
    lines: list[str]
    """What was read, one line per file."""
    scorer: RewardScorer
    loops: dict[str, AgentLoop]


def build_inputs(cfg: RunConfig, tokenizer_dir: Path, model: Optional[Callable[[Any], Any]] = None) -> EvalInputs:
    """The tokenizer in ``tokenizer_dir``, the held-out rows (``data.val_files``), the reward and agent loops.
    ``model(tokenizer)`` builds the reward model (``hpcrl/reward/scoring.py``) when the evaluation scores with it
    (:func:`~hpcrl.reward.scoring.eval_scores_with_model`); ValueError if it does and none is given."""
    torch.set_num_threads(cfg.rollout.torch_threads)
    tokenizer = load_tokenizer(tokenizer_dir)
    rows, lines = load_heldout(cfg, tokenizer)
    with_model = eval_scores_with_model(cfg)
    if with_model and model is None:
        raise ValueError("the evaluation scores with the reward model (reward_model.enable) and none was given; "
                         "to score with a rule instead, set eval.reward.name")
    return EvalInputs(tokenizer, rows, lines, RewardScorer(load_reward(eval_reward(cfg), with_model=with_model),
                                                           model(tokenizer) if with_model else None),
                      make_loops(cfg.agent, tokenizer, rows))


def eval_subscriber(cfg: RunConfig, run_dir: RunDir, reader: str) -> WeightSubscriber:
    """A files-only subscriber named ``reader`` (module docstring)."""
    return make_subscriber(dataclasses.replace(cfg.weights, transport="filesystem"), run_dir, reader, cfg.timeouts)


def start_evaluator(cfg: RunConfig, inputs: EvalInputs, model_dir: Path, closers: contextlib.ExitStack,
                    source: str, steps: StartupSteps | None = None) -> Evaluator:
    """Start the evaluation's engine on ``model_dir`` (a start-up step of ``steps`` when given) and the evaluator
    around it; everything it starts is closed by ``closers`` (the engine's processes die with the job)."""
    name, t = engine_name(cfg), cfg.timeouts
    verify_base(model_dir, cfg.model.base_hash)  # LoRA: the adapters apply to this base only
    runner = EngineRunner()
    closers.callback(runner.close)
    step = steps.step(f"starting the {name} engine", t.engine_start_s + 10) if steps else contextlib.nullcontext()
    with step:
        engine = make_engine(name, eval_engine_options(cfg, model_dir), cfg, runner, t.engine_start_s)
    closers.callback(engine.close)
    closers.callback(stop_reaper, start_reaper(f"the evaluation's {name} engine processes"))
    evaluator = Evaluator(cfg, inputs.tokenizer, inputs.rows, inputs.scorer, inputs.loops, runner, engine, source)
    closers.callback(evaluator.abandon)
    return evaluator
