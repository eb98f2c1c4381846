"""The run's inputs, checked on the login node before anything is created or submitted.

Each of these fails the same way on every restart of a job, so it must fail here, in one
line, instead of after ``resources.max_restarts`` resubmissions:

- **model**: the folder of ``model.path`` exists and holds ``config.json``, weights
  (``*.safetensors`` or ``pytorch_model*.bin``) and a tokenizer that loads;
- **data**: ``data.source`` reads, every row parses (verl's format), prompts tokenize with
  that tokenizer, through its chat template, within ``data.max_prompt_length``'s policy;
- **reward**: ``reward.path`` imports, its function can be called as verl calls it, and it returns a
  score on a real row of each data source (shown to the user); with ``reward_model.enable`` the model's folder,
  kind and parser, and what the function takes of it (``hpcrl/reward/checks.py``), and a generative judge's engine
  can run here like the rollout engine (its package installed);
- **agent**: if any prompt uses the tool agent, its tools build from ``agent.tools``, its
  parser accepts them, and the tokenizer's chat template can append tool responses;
- **evaluation** (``eval.every_versions`` > 0): ``data.val_files`` read and tokenize like the data,
  the evaluation's reward scores a held-out row of each data source, its engine can run;
- **GPUs**: with ``--executor local`` the jobs run here, so the GPUs asked for must be here;
- **the jobs' Python**: ``HPCRL_PYTHON``, when set, is an executable file (``submit.JOB_PYTHON_ENV``);
- **LoRA** (``actor.lora_rank``): the target modules are linear layers of the model, and each engine can serve the
  adapter (``lora_check.py``);
- **the trainer's GPU memory**: its predicted peak per GPU fits ``resources.trainer.gpu_memory_gib``
  (``hpcrl/plan/memory.py``).

Every problem is reported at once (one line each), so one round trip shows them all: in ``hpcrl run`` the
same pass holds the config's problems too (:func:`hpcrl.config.checks.collecting`). What is allowed but almost
surely a mistake (a tokenizer that does not know the data, a reward written for other rows, a held-out set of
another task) is a warning line instead (:mod:`hpcrl.launcher.input_warnings`).

This is also where a shipped config with a placeholder model path is refused: paths are
checked at launch (and by ``--dry-run``), not when a config file is parsed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpcrl.config import ConfigError, DataConfig, RewardConfig, RunConfig, registries
from hpcrl.config.checks import bad, collecting, report, reported
from hpcrl.config.dapo import check_filter_metric
from hpcrl.config.names import BUILTIN_DATA, BUILTIN_MODELS
from hpcrl.launcher.input_warnings import WARNING, another_task, rule_mismatch, unknown_tokens, unwritable_answers
from hpcrl.launcher.lora_check import check_lora
from hpcrl.plan.memory import memory_lines
from hpcrl.launcher.submit import JOB_PYTHON_ENV
from hpcrl.rollout.data import load_model_tokenizer

def check_engine(cfg: RunConfig) -> None:
    """The rollout engine can run here and on this model (:func:`check_engine_for`)."""
    check_engine_for(cfg, cfg.rollout.engine, "rollout.engine")


def check_engine_for(cfg: RunConfig, engine: str, key: str, model: Optional[tuple[str, str]] = None,
                     device: Optional[tuple[str, str]] = None) -> None:
    """What the spec of the engine ``key`` names (``rollout.engine``, ``eval.engine``, ``reward_model.engine``) asks
    of this launch: the package it needs imports in this Python (the jobs run the same one), and off a GPU the
    attention head dim of its model is at least the engine's CPU minimum (vLLM's CPU attention: 64; ``builtin:tiny``
    has 32). ``model`` and ``device``: (key, value) of the engine's model and device (default: the policy's,
    ``model.path`` and ``rollout.device``), the keys named in the fix."""
    import importlib.util

    model_key, path = model or ("model.path", cfg.model.path)
    device_key, on = device or ("rollout.device", cfg.rollout.device)
    spec = registries.engine_spec(engine)
    if spec is None:
        return
    if spec.package and importlib.util.find_spec(spec.package) is None:
        raise bad(key, engine, f"an engine this Python can import ({spec.package} is not installed)",
                  f"{spec.install or 'pip install ' + spec.package}, or {key}="
                  f"{next(n for n, s in registries.ENGINES.items() if not s.package and not s.simulated)}")
    head_dim = model_head_dim(path)
    if spec.cpu_min_head_dim and on != "cuda" and head_dim is not None and head_dim < spec.cpu_min_head_dim:
        wide = [m for m in BUILTIN_MODELS if (model_head_dim(m) or 0) >= spec.cpu_min_head_dim]
        raise bad(model_key, path, f"a model whose attention head dim is >= {spec.cpu_min_head_dim} "
                  f"with {key}={engine} off a GPU (this one's is {head_dim})",
                  f"set model.path={wide[0]}" if path in BUILTIN_MODELS and wide else
                  f"set {device_key}=cuda (with GPUs), or another engine")


def check_judge_engine(cfg: RunConfig) -> None:
    """A generative judge's engine (``reward_model.engine``; ``auto``: ``rollout.engine``'s, whose problems that key
    already says) can run here, on the judge's model (:func:`check_engine_for`). A discriminative model needs none
    (a transformers forward); a folder whose kind cannot be told is reported by ``reward/checks.py``."""
    from hpcrl.reward.models import GENERATIVE, RewardModelLoadError, configured_kind

    rm = cfg.reward_model
    if not rm.enable or (rm.engine == "auto" and reported("rollout.engine")):
        return
    try:
        kind = configured_kind(rm)
    except RewardModelLoadError:
        return
    if kind == GENERATIVE:
        check_engine_for(cfg, rm.engine if rm.engine != "auto" else cfg.rollout.engine, "reward_model.engine",
                         model=("reward_model.path", rm.path), device=("reward_model.device", rm.device))


def model_head_dim(path: str) -> Optional[int]:
    """The attention head dim of ``model.path``: a built-in model's, else its ``config.json``'s (None where that does
    not say; the model check reports a folder that is not one)."""
    import json

    from hpcrl.tiny.model import builtin_head_dim

    if path in BUILTIN_MODELS:
        return builtin_head_dim(path)
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
        config = config.get("text_config", config)
        return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def check_answers(reward: RewardConfig, rows: list[dict], data: DataConfig, key: str, files: list[str]) -> list[str]:
    """A file of ``files`` (the rows of ``key``: data.source, data.val_files) none of whose rows has a ground truth
    at ``data.answer_key`` (a verl parquet without its reward_model column): ConfigError in one line naming the
    column, the file and the key for a built-in rule, which scores every response 0 against an empty answer; a
    warning for a function of your own (it may not need one). [] when every file has answers."""
    from hpcrl.rollout.dataset import file_columns

    for i, path in enumerate(files):
        mine = [r for r in rows if str(r.get("prompt_id", f"{i}:")).split(":")[0] == str(i)] if len(files) > 1 else rows
        if not mine or any(r["answer"] for r in mine) or path in BUILTIN_DATA:
            continue
        columns = file_columns(path)
        what = (f"a column of {key}={path} with each row's ground truth (dots go into nested columns); no row has "
                f"one at {data.answer_key!r}" + (f" (its columns: {', '.join(columns)})" if columns else ""))
        fix = ("set data.answer_key to the column that holds the answers, or write verl's "
               "reward_model: {ground_truth: ...} column into the file")
        if reward.path is None:
            raise bad("data.answer_key", data.answer_key, what + f", so reward.name={reward.name} would score every "
                      "response 0", fix)
        return [f"{WARNING}config data.answer_key: {what}: your reward function gets ground_truth='' for every row; "
                f"fix: {fix}, unless the function needs no ground truth"]
    return []


def check_eval(cfg: RunConfig, tokenizer, training_reward_failed: bool = False,
               train_rows: Optional[list[dict]] = None) -> list[str]:
    """The evaluation job's inputs (``eval.every_versions`` > 0): the held-out files read and tokenize, the
    evaluation's reward imports and scores a held-out row of each data source (not again when it is the training
    reward and that already failed: each problem is said once), its engine can run here. ConfigError in one line
    on the first problem; lines saying what was found, then warnings (:mod:`hpcrl.launcher.input_warnings`:
    ``train_rows`` are the training rows, to tell whether the held-out rows are the same task)."""
    from hpcrl.eval.data import engine_name, eval_reward, load_heldout
    from hpcrl.rollout.reward_fn import probe_reward

    if not cfg.eval.enabled:
        return []
    check_engine_for(cfg, engine_name(cfg), "eval.engine")
    try:
        rows, lines = load_heldout(cfg, tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"config data.val_files: {e}") from None
    reward = eval_reward(cfg)
    model_only = reward is cfg.reward and cfg.reward_model.enable  # scored by the reward model (hpcrl/reward/)
    warnings = [] if model_only else check_answers(reward, rows, cfg.data, "data.val_files", cfg.data.val_files)
    warnings += unknown_tokens(cfg, tokenizer, rows, "data.val_files")
    key = "reward" if reward is cfg.reward else "eval.reward"
    other_task = another_task(train_rows or [], rows)
    warnings += other_task or rule_mismatch(reward, rows, f"{key}.name", "data.val_files")
    if reward is cfg.reward and training_reward_failed:
        return lines + warnings
    try:
        probe = probe_reward(reward, rows, tokenizer)
    except ValueError as e:
        raise ConfigError(f"config {key} (evaluation of data.val_files={','.join(cfg.data.val_files)}): {e}; fix: "
                          f"point data.val_files at held-out rows {key} can score, set eval.reward to a function "
                          "that scores these, or eval.every_versions=0 for no evaluation") from None
    if not other_task:
        warnings += unwritable_answers(cfg, probe, f"{key} (evaluation)")
    e = cfg.eval
    return lines + [f"evaluation job: every {e.every_versions} versions{', version 0' if e.before_training else ''} "
                    f"and the last, {len(rows)} prompts x {e.n} ({'sampled' if e.do_sample else 'greedy'}), engine "
                    f"{engine_name(cfg)}; {probe.line}"] + warnings


@dataclass
class InputsFound:
    """What the input checks found: lines for the user, and the prompt count (``data.epochs`` needs it)."""

    lines: list[str]
    prompts: int
    """Prompts kept after ``data.max_prompt_length``'s policy."""


def check_gpus(cfg: RunConfig, kind: Optional[str]) -> None:
    """With ``--executor local`` the jobs run on this machine: GPUs asked for must be here."""
    if kind != "local":
        return
    want = max(cfg.resources.trainer.gpus_per_node, cfg.resources.rollout.gpus_per_node)
    if not want:
        return
    import torch

    have = torch.cuda.device_count()
    if have < want:
        key = "trainer" if cfg.resources.trainer.gpus_per_node >= want else "rollout"
        raise bad(f"resources.{key}.gpus_per_node", want, f"at most the {have} GPU(s) of this machine with "
                  "--executor local (the jobs run here)", "set resources.trainer.gpus_per_node=0 and "
                  "resources.rollout.gpus_per_node=0 to run on CPU (rollout.dtype and actor.bf16 'auto' then mean float32), "
                  "or --executor slurm")


def check_job_python() -> None:
    """``HPCRL_PYTHON`` (the Python the jobs run, when set) is an executable file: else every job would fail to
    start, each restart again."""
    python = os.environ.get(JOB_PYTHON_ENV)
    if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        report(ConfigError(f"environment {JOB_PYTHON_ENV}: got {python!r}; allowed: an executable file, the Python "
                           "the jobs run; fix: point it at the Python that has hpcrl installed (.venv/bin/python), "
                           "or unset it (the jobs then run the launcher's own Python)"))


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text if text.startswith(("config ", "override ")) else f"config {text}"


EVAL_KEYS = ("eval.every_versions", "eval.engine", "eval.reward.", "eval.max_prompts", "eval.response_length", "data.",
             "rollout.response_length", "rollout.engine", "rollout.device", "model.path")
"""What :func:`check_eval` reads: it is skipped while one of them is reported wrong."""


MEMORY_KEYS = ("actor.", "model.path", "resources.trainer.", "rollout.response_length", "rollout.n",
               "data.max_prompt_length")
"""What :func:`hpcrl.plan.memory.memory_lines` reads."""


def _attempt(fn, *args, skip: tuple[str, ...] = ()):
    """``fn(*args)``, or None with its problem reported (and not called at all when a key it reads, one of
    ``skip``, is already reported wrong: it would say the same again)."""
    if reported(*skip):
        return None
    try:
        return fn(*args)
    except (ConfigError, ValueError, OSError) as e:
        if isinstance(e, ConfigError) and e.key is not None:
            report(e)
        else:
            for line in _one_line(e).splitlines():
                report(ConfigError(line))
        return None


def _rows(cfg: RunConfig) -> list[dict]:
    from hpcrl.rollout.dataset import load_rows

    try:
        return load_rows(cfg.data, cfg.rollout.response_length)
    except (ValueError, OSError) as e:
        raise ConfigError(f"config data.source: {e}") from None


def derive_total_steps(cfg: RunConfig, prompts: int, capped: bool) -> Optional[str]:
    """``data.epochs`` (verl: trainer.total_epochs) x prompts kept -> ``rollout.total_rollout_steps``, at most
    the value given there when ``capped`` (it was set too: verl takes the same minimum); the line saying so, or
    None without data.epochs. Changes ``cfg`` in place."""
    epochs = cfg.data.epochs
    if epochs is None:
        return None
    total, cap = epochs * prompts, cfg.rollout.total_rollout_steps
    if capped and cap < total:
        how = f"capped by rollout.total_rollout_steps={cap} (as verl caps it)"
    else:
        cfg.rollout.total_rollout_steps, how = total, "rollout.total_rollout_steps"
    cfg.validate()
    return (f"data.epochs={epochs} x {prompts} prompts = {total} groups, {how}: {cfg.rollout.total_rollout_steps} "
            f"groups = {cfg.total_updates} updates of R={cfg.groups_per_update}")


def check_inputs(cfg: RunConfig, kind: Optional[str] = None) -> InputsFound:
    """Check the engine, GPUs (``kind`` local), model, data, reward, agent and evaluation (module docstring);
    return what was found, warnings last (``warning: ...``, :mod:`hpcrl.launcher.input_warnings`). Every problem
    is reported in one pass, one line each, with the config's own when the caller's pass holds both
    (:func:`hpcrl.config.checks.collecting`); a check whose keys are already reported wrong is skipped. Creates
    nothing."""
    with collecting():
        return _check_inputs(cfg, kind)


def _check_inputs(cfg: RunConfig, kind: Optional[str]) -> InputsFound:
    from hpcrl.reward.checks import check_reward_model
    from hpcrl.rollout.data import encode_rows
    from hpcrl.rollout.reward_fn import RewardProbe, load_reward, probe_reward

    _attempt(check_engine, cfg, skip=("rollout.engine", "rollout.device", "model.path"))
    _attempt(check_gpus, cfg, kind, skip=("resources.trainer.gpus_per_node", "resources.rollout.gpus_per_node"))
    check_job_python()
    lines_lora = _attempt(check_lora, cfg, skip=("actor.lora_", "model.path")) or []
    lines_lora += _attempt(memory_lines, cfg, skip=MEMORY_KEYS) or []
    tokenizer = _attempt(load_model_tokenizer, cfg, skip=("model.path",))
    rows = _attempt(_rows, cfg, skip=("data.", "rollout.response_length"))
    encoded = None
    if rows is not None and tokenizer is not None:
        try:
            encoded = encode_rows(tokenizer, cfg.data, rows)
        except (ValueError, OSError) as e:
            report(ConfigError(f"config data.source: {e}"))
    lines = ([encoded[1].line(cfg.data, encoded[2])] if encoded else []) + lines_lora
    warnings = unknown_tokens(cfg, tokenizer, encoded[0], "data.source") if encoded else []
    probe = None
    model_only = cfg.reward_model.enable and cfg.reward.path is None  # the reward is the model's: no answer needed
    if rows and not model_only:
        warnings += _attempt(check_answers, cfg.reward, rows, cfg.data, "data.source", [cfg.data.source],
                             skip=("data.", "reward.")) or []
    if cfg.reward_model.enable:
        lines += _attempt(check_reward_model, cfg, skip=("reward_model.", "reward.")) or []
        _attempt(check_judge_engine, cfg, skip=("reward_model.path", "reward_model.kind", "reward_model.engine",
                                                "reward_model.device"))
    elif rows and not reported("data.answer_key"):
        probe = _attempt(probe_reward, cfg.reward, encoded[0] if encoded else rows, tokenizer, skip=("reward.",))
    elif not rows:
        _attempt(load_reward, cfg.reward, skip=("reward.",))
    if isinstance(probe, RewardProbe):
        lines.append(probe.line)
        _attempt(check_filter_metric, cfg, probe.metrics, skip=("algorithm.filter_groups.", "reward."))
        warnings += unwritable_answers(cfg, probe, "reward")
        warnings += rule_mismatch(cfg.reward, rows, "reward.name", "data.source")
    if encoded:
        lines += _attempt(check_agent, cfg, tokenizer, encoded[0], skip=("agent.",)) or []
    if tokenizer is not None:
        train_rows = encoded[0] if encoded else rows
        lines += _attempt(check_eval, cfg, tokenizer, not isinstance(probe, RewardProbe), train_rows,
                          skip=EVAL_KEYS) or []
    return InputsFound([x for x in lines if not x.startswith(WARNING)] + warnings
                       + [x for x in lines if x.startswith(WARNING)], len(encoded[0]) if encoded else 0)


def check_agent(cfg: RunConfig, tokenizer, rows: list[dict]) -> list[str]:
    """Build the agent loops the rollout jobs will build; ConfigError in one line if one cannot be."""
    from hpcrl.rollout.loops import TOOL_AGENT, loop_name, make_loops

    n = sum(loop_name(r, cfg.agent) == TOOL_AGENT for r in rows)
    if n and not cfg.agent.tools:
        raise bad("agent.tools", [], f"at least one tool ({n} prompts use the tool agent)",
                  "e.g. agent.tools=[{name: calculator}]")
    try:
        loops = make_loops(cfg.agent, tokenizer, rows)
    except ValueError as e:
        raise ConfigError(f"config agent: {e}") from None
    if not n:
        return []
    tools = ", ".join(loops[TOOL_AGENT].tools)
    return [f"tool agent for {n} of {len(rows)} prompts: tools {tools}, parser {cfg.agent.tool_parser}"]
