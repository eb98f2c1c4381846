"""``hpcrl eval``: evaluate weight versions of a run, or any model folder, on held-out prompts, with the
evaluation job's code, metrics and records.

    hpcrl eval RUN [--versions 0,20,last] [--data FILE ...] [--n 8 ...] [--out DIR] [key=value ...]
    hpcrl eval --model HF_FOLDER --data FILE [--config CONFIG] [--n 8 ...] [--out DIR] [key=value ...]

With a run, the config is the run's frozen one (``key=value`` and the flags change it for this evaluation
only); each version is taken through the weight subscriber as reader ``eval-offline`` (verified, pinned while
a heartbeat of that name beats), and the rows go to the run's ``logs/eval.jsonl`` marked ``offline`` (refused
while the run's evaluation job is alive: one writer per file) or to ``--out DIR`` (``DIR/logs/eval.jsonl``).
With ``--model``, the config is ``--config`` (default: the built-in defaults) and the rows, version -1, go to
``--out`` (default ``./hpcrl-eval-<folder name>``).

Only the light modules are imported at the top: ``hpcrl`` builds this command's parser for every command.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hpcrl.config import ConfigError, RunConfig, config_from_dict, load_config, parse_override
from hpcrl.config import registries
from hpcrl.control.records import HeartbeatThread, live_jobs
from hpcrl.eval.writer import EvalLogWriter
from hpcrl.logs.eval_log import EVALUATED, OFFLINE, EvalRow
from hpcrl.rundir.paths import EVAL_JOB, EVAL_OFFLINE_JOB, WEIGHT_DELTA, RunDir

log = logging.getLogger("hpcrl.eval")

FLAGS = {"n": "eval.n", "temperature": "eval.temperature", "top_p": "eval.top_p", "top_k": "eval.top_k",
         "max_prompts": "eval.max_prompts", "response_length": "eval.response_length", "engine": "eval.engine"}
"""Command-line flags that set an ``eval.*`` key for this evaluation."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``hpcrl eval``."""
    p.add_argument("run_dir", nargs="?", metavar="RUN", help="a run directory whose weight versions to evaluate")
    p.add_argument("overrides", nargs="*", help="key=value changes of the config for this evaluation")
    p.add_argument("--model", metavar="HF_FOLDER", help="evaluate this model folder instead of a run's versions")
    p.add_argument("--config", metavar="CONFIG", help="with --model: the config (data keys, reward, eval.*)")
    p.add_argument("--tokenizer", metavar="DIR", help="with --model: the folder of the tokenizer, if the model folder "
                                                     "has none (a run's weight version: its run's base model folder)")
    p.add_argument("--versions", default="last", help="with a run: comma-separated versions, 'last' = the newest "
                                                      "(default last)")
    p.add_argument("--data", nargs="+", metavar="FILE", help="held-out prompt files (default: data.val_files)")
    p.add_argument("--out", metavar="DIR", help="write DIR/logs/eval.jsonl and eval_samples.jsonl.gz (default: the "
                                                "run's logs; with --model ./hpcrl-eval-<folder>)")
    for flag, key in FLAGS.items():
        what = (f": one of {', '.join(registries.ENGINES)} (default: the run's rollout.engine)" if flag == "engine"
                else " (default: the config's)")
        p.add_argument("--" + flag.replace("_", "-"), type=str if flag == "engine" else
                       (float if flag in ("temperature", "top_p") else int), help=f"sets {key}{what}")
    p.add_argument("--do-sample", action="store_true", default=None, help="sample (eval.do_sample=true); "
                                                                          "implied by --n > 1")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (eval.do_sample=false)")


def _set_dotted(tree: dict, dotted: str, value) -> None:
    """``tree[a][b] = value`` for ``a.b`` (sections created as needed)."""
    *path, last = dotted.split(".")
    for part in path:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _config(base: Optional[RunConfig], a: argparse.Namespace) -> RunConfig:
    """The config of this evaluation: ``base`` (or ``--config``, or the defaults) with the overrides and flags."""
    tree = base.to_dict() if base is not None else {}
    if base is None and a.config:
        tree = load_config(a.config).to_dict()
    for text in a.overrides:
        _set_dotted(tree, *parse_override(text))
    for flag, key in FLAGS.items():
        if getattr(a, flag) is not None:
            _set_dotted(tree, key, getattr(a, flag))
    if a.greedy:
        _set_dotted(tree, "eval.do_sample", False)
    elif a.do_sample or (a.n or 1) > 1:
        _set_dotted(tree, "eval.do_sample", True)
    if a.data:
        _set_dotted(tree, "data.val_files", list(a.data))
    _set_dotted(tree, "eval.every_versions", 0)  # no evaluation *job*: this command is the evaluation
    cfg = config_from_dict(tree)
    if not cfg.data.val_files:
        raise ConfigError("no held-out prompts: pass --data FILE (or set data.val_files)")
    return cfg


def _versions(spec: str, published: list[int]) -> list[int]:
    """``0,20,last`` -> version numbers, ascending (``last`` = the newest published)."""
    out = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "last":
            if not published:
                raise ValueError("no weight version is published in this run yet")
            out.add(published[-1])
        elif part.isdigit():
            out.add(int(part))
        else:
            raise ValueError(f"--versions {spec!r}: comma-separated version numbers or 'last', e.g. 0,20,last")
    return sorted(out)


def _line(row: EvalRow) -> str:
    what = f"v{row.version} (step {row.trainer_step})" if row.version >= 0 else row.model
    score = f"{row.score:.3f}" if row.score is not None else "n/a"
    s = row.sampling
    how = f"n={s['n']} {'sampled, temperature ' + format(s['temperature'], 'g') if s['do_sample'] else 'greedy'}"
    return f"{what}: {row.score_name} {score}; {row.prompts} prompts, {how}, {row.eval_s:.1f}s"


def _evaluate_run(a: argparse.Namespace, emit: Callable[[str], None]) -> int:
    """A run's versions (module docstring). Version 0 no longer on disk is the base model, of which it is a copy."""
    from hpcrl.eval.data import sampling
    from hpcrl.eval.parts import build_inputs, eval_subscriber, start_evaluator
    from hpcrl.reward.scoring import model_rewards
    from hpcrl.weights import WeightVersionBad, WeightVersionGone

    rd = RunDir(a.run_dir)
    cfg = _config(rd.load_config(), a)
    dest = RunDir(a.out) if a.out else rd
    if dest is rd and EVAL_JOB in live_jobs(rd, cfg.timeouts.heartbeat_stale_s):
        raise ValueError(f"the run's evaluation job is alive and writes {rd.eval_log}; pass --out DIR")
    base = rd.model_dir(cfg.model.path)
    with contextlib.ExitStack() as closers:
        weights = eval_subscriber(cfg, rd, EVAL_OFFLINE_JOB)
        closers.callback(weights.close)
        on_disk = [v for v in weights.published_versions() if not weights.is_bad(v)]
        versions = _versions(a.versions, on_disk)
        inputs = build_inputs(cfg, base, lambda tokenizer: model_rewards(cfg, rd, EVAL_OFFLINE_JOB, tokenizer, local=True))
        if inputs.scorer.model is not None:
            closers.callback(inputs.scorer.model.close)
        for line in inputs.lines:
            emit(line)
        heartbeat = HeartbeatThread(rd, EVAL_OFFLINE_JOB, "eval", cfg.timeouts.heartbeat_interval_s).start()
        closers.callback(heartbeat.stop, "done")  # its pins count only while it beats
        evaluator = start_evaluator(cfg, inputs, base, closers, OFFLINE)  # the engine starts on the base model
        writer = EvalLogWriter(dest.eval_log, dest.eval_samples, cfg.eval.keep_samples_versions)
        closers.callback(writer.close)
        failed = 0
        for v in versions:
            row = EvalRow(version=v, status=EVALUATED, source=OFFLINE, started_s=time.time(), n=cfg.eval.n,
                          prompts=len(inputs.rows), sampling=sampling(cfg))
            if v == 0 and v not in on_disk and v == versions[0]:
                emit(f"v0 is not on disk (retention); evaluating the base model {base}, of which v0 is a copy")
                row.trainer_step, row.model = 0, str(base)
                _finish(row, evaluator.evaluate(0), writer, emit)
                continue
            try:
                wv = weights.take(v)
            except (WeightVersionGone, WeightVersionBad) as e:
                emit(f"v{v}: not evaluated: {e} (on disk: {', '.join(map(str, weights.published_versions()))})")
                failed += 1
                continue
            with wv:  # pinned while evaluated
                row.load_s = wv.transfer_s + evaluator.load(wv)
                row.trainer_step, row.published_s = wv.manifest.trainer_step, wv.manifest.published_s
                _finish(row, evaluator.evaluate(v), writer, emit)
        emit(f"rows: {dest.eval_log}; samples: {dest.eval_samples}")
    return 1 if failed else 0


def _finish(row: EvalRow, res, writer: EvalLogWriter, emit: Callable[[str], None]) -> None:
    """Fill ``row`` from an evaluation, commit it with its samples, print its line."""
    row.eval_s, row.score, row.score_name, row.metrics = res.eval_s, res.score, res.score_name, res.metrics
    emit(_line(writer.commit(row, res.samples)))


def _evaluate_model(a: argparse.Namespace, emit: Callable[[str], None]) -> int:
    """A model folder (module docstring)."""
    from hpcrl.eval.data import sampling
    from hpcrl.eval.parts import build_inputs, start_evaluator

    folder = Path(a.model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {folder}: not a Hugging Face model folder (no config.json)")
    if (folder / WEIGHT_DELTA).is_file():
        raise ValueError(f"--model {folder}: a delta weight version (weights.delta: its {WEIGHT_DELTA} holds changes "
                         "against another version, not a model); evaluate the run (hpcrl eval RUN --versions N), or "
                         "`hpcrl export RUN --version N --out DIR` and give --model DIR")
    tokenizer = Path(a.tokenizer).expanduser() if a.tokenizer else folder
    if not any((tokenizer / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"{tokenizer} holds no tokenizer; pass --tokenizer DIR (for a run's weights/vN: "
                         "--tokenizer RUN/base_model, or the model.path it trained from)")
    cfg = _config(None, a)
    dest = RunDir(a.out or Path.cwd() / f"hpcrl-eval-{folder.name}")
    with contextlib.ExitStack() as closers:
        inputs = build_inputs(cfg, tokenizer)
        for line in inputs.lines:
            emit(line)
        evaluator = start_evaluator(cfg, inputs, folder, closers, OFFLINE)
        writer = EvalLogWriter(dest.eval_log, dest.eval_samples, cfg.eval.keep_samples_versions)
        closers.callback(writer.close)
        row = EvalRow(version=-1, status=EVALUATED, source=OFFLINE, started_s=time.time(), n=cfg.eval.n,
                      prompts=len(inputs.rows), sampling=sampling(cfg), model=str(folder))
        _finish(row, evaluator.evaluate(-1), writer, emit)
        emit(f"rows: {dest.eval_log}; samples: {dest.eval_samples}")
    return 0


def eval_command(a: argparse.Namespace) -> int:
    """``hpcrl eval``: exit 0 when every version asked for was evaluated, 1 if one could not be, 2 on bad input."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Loading weights" bars are not this command's output
    except ImportError:
        pass
    if (a.run_dir is None) == (a.model is None):
        print("hpcrl eval: error: give a run directory (RUN) or --model HF_FOLDER, not both", file=sys.stderr)
        return 2
    emit = lambda line: print(line, flush=True)  # noqa: E731 - the command's output, as it comes
    try:
        return _evaluate_run(a, emit) if a.run_dir else _evaluate_model(a, emit)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"hpcrl eval: error: {e}", file=sys.stderr)
        return 2
