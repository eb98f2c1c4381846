"""Everything a rollout job builds once, before its loop: :class:`RolloutParts`.

Built in one place (:func:`build_parts`) from the frozen config, in this order: tokenizer, prompts,
reward, agent loops, engine (the slow step; its child processes get a reaper), weight subscriber,
shard writer (recovered from its own folder), admission budget and prompt claims (this writer's count reset
to what it committed, its uncommitted claims kept: ``control/claims.py``; gone writers' claims reclaimed:
``control/reclaim.py``), the prompts it holds, saved groups in flight (of those prompts only), the version log,
the group pool. Nothing is
attached to the job later. An error in the run's inputs (model, tokenizer, data, reward) is recorded
as fatal (a restart would repeat it); whatever was built before any error is closed again.
"""
from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.config import RunConfig
from hpcrl.control.admission import Admission
from hpcrl.control.fatal import fatal_inputs
from hpcrl.control.startup import StartupSteps
from hpcrl.logs.run_logs import MetricsLog
from hpcrl.process.reaper import start_reaper, stop_reaper
from hpcrl.reward.scoring import model_rewards
from hpcrl.rollout.agent_loop import AgentLoop
from hpcrl.rollout.data import PromptCounts, encode_rows
from hpcrl.rollout.dataset import ClaimedPrompts, PromptStream, load_rows
from hpcrl.rollout.engine import Engine, EngineOptions, EngineRunner
from hpcrl.rollout.engines import make_engine
from hpcrl.rollout.loops import make_loops
from hpcrl.rollout.in_flight import InFlightStates
from hpcrl.rollout.reward_fn import RewardScorer, load_reward
from hpcrl.rollout.shaping import RewardShaping
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import ShardWriter
from hpcrl.tiny.model import load_tokenizer
from hpcrl.weights import WeightSubscriber, make_subscriber
from hpcrl.weights.adapter import verify_base

log = logging.getLogger("hpcrl.rollout")


def engine_options(cfg: RunConfig, model_dir) -> EngineOptions:
    """``rollout.*``'s fields every engine reads, resolved for this job: ``device: auto`` becomes cuda when a GPU is
    visible, ``dtype: auto`` bfloat16 there (float32 on cpu); an engine's own fields it reads itself (``build``)."""
    ro = cfg.rollout
    device = ro.device if ro.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.device=cuda but this job sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): check resources.rollout.gpus_per_node")
    return EngineOptions(model_dir=model_dir, max_new_tokens=ro.response_length, temperature=ro.temperature,
                         top_p=ro.top_p, device=device, dtype=ro.dtype_on(device), seed=cfg.model.seed,
                         lora_rank=cfg.actor.lora_rank or 0)


def scoring_groups(cfg: RunConfig) -> int:
    """Groups a rollout job may hold waiting for the reward model beyond those it generates (``reward_model.
    scoring_groups``; none without a reward model: a rule scores in microseconds)."""
    rm = cfg.reward_model
    if not rm.enable:
        return 0
    return rm.scoring_groups if rm.scoring_groups is not None else cfg.knobs.group_bound


@dataclass
class RolloutParts:
    """What one rollout job holds for its whole life (module docstring)."""

    tokenizer: Any
    stream: PromptStream
    """Prompt index -> row (chat template and max_prompt_length applied)."""
    prompt_counts: PromptCounts
    """What max_prompt_length did to the prompt file (rows filtered or truncated)."""
    scorer: RewardScorer
    shaping: RewardShaping
    """DAPO's overlong penalty and the value dynamic sampling filters on, applied to each score."""
    loops: dict[str, AgentLoop]
    """The agent loops the rows name."""
    runner: EngineRunner
    """The engine's event loop; every engine call goes through it with a deadline."""
    engine: Engine
    weights: WeightSubscriber
    shards: ShardWriter
    admission: Admission
    positions: ClaimedPrompts
    """The prompts this writer holds claims on and generates before claiming new ones."""
    states: InFlightStates
    """Groups in flight, saved for this writer's next job (partial rollout)."""
    metrics: MetricsLog
    """``logs/rollout-<writer>.jsonl``: one row per weight version."""
    pool: ThreadPoolExecutor
    """One thread per group in flight (generating, or waiting for the reward model: :func:`scoring_groups`)."""
    closers: contextlib.ExitStack
    """Closes the engine (and its processes), its loop and the subscriber, last built first."""

    def close(self) -> None:
        """Release the engine, its processes and loop, and the subscriber's threads (logged, never raises)."""
        try:
            self.closers.close()
        except Exception as e:  # noqa: BLE001 - shutting down: say so and go on
            log.warning("closing the engine failed: %s", e)


def build_parts(cfg: RunConfig, run_dir: RunDir, writer: str, steps: StartupSteps) -> RolloutParts:
    """Build every part of writer ``writer``, each slow part a start-up step of ``steps``."""
    torch.set_num_threads(cfg.rollout.torch_threads)
    mdir = run_dir.model_dir(cfg.model.path)
    t = cfg.timeouts
    with contextlib.ExitStack() as closers:
        job = RunDir.rollout_job(writer)
        with steps.step("loading the tokenizer, prompts and reward"):
            with fatal_inputs(run_dir, job, f"loading the tokenizer of {mdir}", "model"):
                tokenizer = load_tokenizer(mdir)
            with fatal_inputs(run_dir, job, f"loading the prompts of {cfg.data.source}", "data"):
                rows = load_rows(cfg.data, cfg.rollout.response_length)
                rows, counts, template = encode_rows(tokenizer, cfg.data, rows)
            with fatal_inputs(run_dir, job, "loading the reward", "reward"):
                reward = load_reward(cfg.reward, with_model=cfg.reward_model.enable)
            with fatal_inputs(run_dir, job, "building the agent loops", "agent"):
                loops = make_loops(cfg.agent, tokenizer, rows)
        model = None
        if cfg.reward_model.enable:  # hpcrl/reward/: the reward jobs' client, or the model in this job
            with steps.step("reaching the reward model", t.job_start_s + t.engine_start_s), \
                    fatal_inputs(run_dir, job, "loading the reward model", "reward_model"):
                model = model_rewards(cfg, run_dir, job, tokenizer)
            closers.callback(model.close)
        scorer = RewardScorer(reward, model)
        with fatal_inputs(run_dir, job, f"loading the model {mdir} into the {cfg.rollout.engine} engine", "model"):
            verify_base(mdir, cfg.model.base_hash)  # LoRA: the adapters apply to this base only
            runner = EngineRunner()
            closers.callback(runner.close)
            with steps.step(f"starting the {cfg.rollout.engine} engine", t.engine_start_s + 10):  # its own limit first
                engine = make_engine(cfg.rollout.engine, engine_options(cfg, mdir), cfg, runner, t.engine_start_s)
            closers.callback(engine.close)
            closers.callback(stop_reaper, start_reaper(f"the {cfg.rollout.engine} engine's processes"))
        log.info("%s", counts.line(cfg.data, template))
        weights = make_subscriber(cfg.weights, run_dir, writer, t, engine.receive_device)
        closers.callback(weights.close)
        with steps.step(f"recovering writer {writer}'s shards, admission count and prompt claims"):
            k = cfg.knobs
            admission = Admission(run_dir, writer, k.admission_budget, reclaim_after_s=t.heartbeat_stale_s,
                                  bound=k.group_bound, share=k.budget_share,
                                  lag=(k.groups_per_version, k.max_lag_bound))
            shards = ShardWriter(run_dir, writer, cfg.rollout.seal_groups, cfg.rollout.seal_interval_s,
                                 skips=SkipLog(run_dir), commit_guard=admission.committing)
            held = admission.join(shards.committed_groups, shards.committed_prompt_indices, shards.skipped_at_start)
        parts = RolloutParts(
            tokenizer=tokenizer, stream=PromptStream(rows, cfg.data.seed), prompt_counts=counts, scorer=scorer,
            shaping=RewardShaping(cfg), loops=loops, runner=runner,
            engine=engine, weights=weights, shards=shards, admission=admission,
            positions=ClaimedPrompts(held),
            states=InFlightStates(run_dir.in_flight_states(writer), cfg.async_training.partial_rollout, held),
            metrics=MetricsLog(run_dir.rollout_metrics(writer)),
            # its bound and the groups waiting for their rewards, plus room for groups the commit refused and
            # starts again (threads are made as needed)
            pool=ThreadPoolExecutor(k.group_bound + scoring_groups(cfg) + k.admission_budget,
                                    thread_name_prefix="group"),
            closers=closers.pop_all())
    return parts
