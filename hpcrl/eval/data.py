"""The held-out prompts (``data.val_files``) and the evaluation's reward and engine options, built with the
rollout job's own code (rows in verl's format, the chat template, ``data.max_prompt_length``'s policy, the
reward function); the launcher checks them with this code before anything is submitted
(``hpcrl/launcher/inputs.py``).

Each file keeps its rows' ``data_source``; a prompt's id is ``<file index>:<row index>`` (verl's ``uid``:
the n responses of one prompt share it). ``eval.max_prompts`` keeps a seeded subset (``data.seed``, in file
order), the same for every version, so the curves compare like with like.
"""
from __future__ import annotations

import dataclasses
import numpy as np

from hpcrl.config import RewardConfig, RunConfig
from hpcrl.rollout.data import encode_rows
from hpcrl.rollout.dataset import load_rows
from hpcrl.rollout.engine import EngineOptions


def response_length(cfg: RunConfig) -> int:
    """Max new tokens of an evaluation response: ``eval.response_length``, else ``rollout.response_length``."""
    return cfg.eval.response_length or cfg.rollout.response_length


def engine_name(cfg: RunConfig) -> str:
    """The evaluation's engine: ``eval.engine``, else ``rollout.engine``."""
    return cfg.eval.engine or cfg.rollout.engine


def eval_reward(cfg: RunConfig) -> RewardConfig:
    """The evaluation's reward: ``eval.reward``, else the training reward."""
    return cfg.eval.reward.resolve(cfg.reward)


def sampling(cfg: RunConfig) -> dict:
    """How responses are sampled, as the rows of ``logs/eval.jsonl`` record it."""
    e = cfg.eval
    return {"n": e.n, "do_sample": e.do_sample, "temperature": e.temperature if e.do_sample else 0.0,
            "top_p": e.top_p if e.do_sample else 1.0, "top_k": e.top_k if e.do_sample else -1,
            "response_length": response_length(cfg), "engine": engine_name(cfg)}


def eval_engine_options(cfg: RunConfig, model_dir) -> EngineOptions:
    """``rollout.*``'s engine options with the evaluation's sampling: greedy (temperature 0) unless
    ``eval.do_sample``."""
    from hpcrl.rollout.parts import engine_options  # the job's parts (torch): not for the launcher's checks

    e = cfg.eval
    greedy = not e.do_sample
    return dataclasses.replace(engine_options(cfg, model_dir), max_new_tokens=response_length(cfg),
                               temperature=0.0 if greedy else e.temperature, top_p=1.0 if greedy else e.top_p,
                               top_k=-1 if greedy else e.top_k)


def load_heldout(cfg: RunConfig, tokenizer) -> tuple[list[dict], list[str]]:
    """The held-out rows (``data.val_files``), each with ``prompt_ids``, ``prompt_id`` and ``data_source``, and one
    line per file saying what was read; ValueError naming the file and row."""
    rows, lines = [], []
    for i, path in enumerate(cfg.data.val_files):
        data = dataclasses.replace(cfg.data, source=path)
        raw = load_rows(data, response_length(cfg))
        for j, r in enumerate(raw):
            r["prompt_id"] = f"{i}:{j}"
        kept, counts, template = encode_rows(tokenizer, data, raw)
        rows += kept
        lines.append(f"held-out {path}: {counts.line(data, template)}")
    if not rows:
        raise ValueError("data.val_files: no held-out prompt (set data.val_files)")
    limit = cfg.eval.max_prompts
    if limit is not None and limit < len(rows):
        keep = np.sort(np.random.default_rng(cfg.data.seed).choice(len(rows), size=limit, replace=False))
        rows = [rows[int(k)] for k in keep]
        lines.append(f"held-out: eval.max_prompts={limit}: a seeded subset of {limit} prompts")
    return rows, lines
