"""Prompt rows in verl's format, and how a prompt becomes token ids.

A row of a ``.parquet`` / ``.jsonl`` file, as verl's data preprocessing writes it::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips ..."}],   # or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

:func:`parse_row` turns it into ``{prompt, answer, data_source, extra_info}``: the prompt
column is ``data.prompt_key``, the ground truth is ``data.answer_key`` (dots go into nested
columns), the rest is handed to the reward function as verl does.

:class:`PromptEncoder` renders the prompt with the tokenizer's chat template (generation
prompt added; ``data.apply_chat_template``) and applies ``data.max_prompt_length`` with the
policy of ``data.truncation``: ``filter`` drops the row, ``left``/``right`` cut tokens from
that side, ``error`` refuses the file. The counts are logged by the rollout job and printed
by the launcher. The launcher runs the same code before submission, so an ``error`` or a
file with no prompt left fails before any job starts; :func:`load_model_tokenizer` is the tokenizer it (and
``hpcrl plan``) encodes with, with a one-line error for a model folder the jobs could not load.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.config import DataConfig, RunConfig, registries
from hpcrl.config.checks import bad
from hpcrl.config.names import BUILTIN_MODELS


def _plain(value: Any) -> Any:
    """numpy arrays / scalars (parquet gives lists as arrays) -> lists and Python scalars."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _lookup(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def parse_row(raw: dict, cfg: DataConfig, where: str) -> dict:
    """One file row -> ``{prompt, answer, data_source, extra_info}``; ValueError naming ``where``
    (file and row) for a prompt that is neither a string nor a list of chat messages."""
    row = _plain(raw)
    prompt = row.get(cfg.prompt_key)
    if prompt is None:
        raise ValueError(f"{where} has no column {cfg.prompt_key!r} (data.prompt_key); columns: {sorted(row)}")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError(f"{where}: column {cfg.prompt_key!r} must be a string or a non-empty list of "
                             f"{{role, content}} chat messages, got {str(prompt)[:120]}")
    elif not isinstance(prompt, str):
        prompt = str(prompt)
    answer = _lookup(row, cfg.answer_key)
    extra = row.get("extra_info")
    if row.get("agent_name") not in (None, "", *registries.AGENT_LOOPS):
        raise ValueError(f"{where}: agent_name {row['agent_name']!r} is not one of {', '.join(registries.AGENT_LOOPS)}")
    return {"prompt": prompt, "answer": "" if answer is None else str(answer),
            "data_source": str(row.get("data_source") or ""), "extra_info": extra if isinstance(extra, dict) else None,
            "agent_name": row.get("agent_name") or None}


def has_chat_template(tokenizer) -> bool:
    """The tokenizer ships a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass
class PromptCounts:
    """What max_prompt_length did to the file (one log line)."""

    rows: int = 0
    kept: int = 0
    filtered: int = 0
    truncated: int = 0
    longest: int = 0
    """Longest prompt before the policy, in tokens."""

    def line(self, cfg: DataConfig, template: bool) -> str:
        """``data: 100 prompts, chat template on; max_prompt_length=512 (filter): 3 filtered ...``."""
        s = f"data: {self.rows} prompts, chat template {'on' if template else 'off'}, longest {self.longest} tokens"
        if cfg.max_prompt_length is not None:
            s += (f"; max_prompt_length={cfg.max_prompt_length} (truncation={cfg.truncation}): "
                  f"{self.filtered} filtered, {self.truncated} truncated, {self.kept} kept")
        return s


class PromptEncoder:
    """Prompt (string or chat messages) -> token ids, with the chat template and the length policy."""

    def __init__(self, tokenizer, cfg: DataConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        has = has_chat_template(tokenizer)
        if cfg.apply_chat_template and not has:
            raise ValueError("data.apply_chat_template=true but the tokenizer has no chat template; "
                             "set data.apply_chat_template=null (or false) or use a model folder with one")
        self.template = has if cfg.apply_chat_template is None else cfg.apply_chat_template

    def encode(self, prompt: str | list) -> list[int]:
        """Token ids of one prompt, before the length policy."""
        if self.template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not isinstance(prompt, str):  # messages without a template: their contents, one per line
            prompt = "\n".join(str(m["content"]) for m in prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def prepare(self, rows: list[dict], where: str = "data.source") -> tuple[list[dict], PromptCounts]:
        """Each row gains ``prompt_ids``; rows over max_prompt_length are filtered or cut (or an
        error); ValueError if a prompt is empty or none is left."""
        limit, policy = self.cfg.max_prompt_length, self.cfg.truncation
        counts = PromptCounts(rows=len(rows))
        out = []
        for i, row in enumerate(rows):
            ids = self.encode(row["prompt"])
            if not ids:
                raise ValueError(f"{where} row {i}: the prompt tokenizes to nothing: {str(row['prompt'])[:80]!r}")
            counts.longest = max(counts.longest, len(ids))
            if limit is not None and len(ids) > limit:
                if policy == "error":
                    raise ValueError(f"{where} row {i}: prompt of {len(ids)} tokens > data.max_prompt_length="
                                     f"{limit}; raise the limit or set data.truncation=filter|left|right")
                if policy == "filter":
                    counts.filtered += 1
                    continue
                ids = ids[-limit:] if policy == "left" else ids[:limit]
                counts.truncated += 1
            out.append(dict(row, prompt_ids=ids))
        counts.kept = len(out)
        if not out:
            raise ValueError(f"{where}: every prompt is longer than data.max_prompt_length={limit}; raise it")
        return out, counts


def encode_rows(tokenizer, cfg: DataConfig, rows: list[dict]) -> tuple[list[dict], PromptCounts, bool]:
    """:meth:`PromptEncoder.prepare` in one call: (rows with ``prompt_ids``, counts, template on)."""
    enc = PromptEncoder(tokenizer, cfg)
    kept, counts = enc.prepare(rows, cfg.source)
    return kept, counts, enc.template


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
