"""Prompts as an endless, reproducible stream: index i -> (prompt, answer).

Stream index ``i`` is row ``perm_e[i mod N]`` of epoch ``e = i // N``, where each
epoch has its own seeded permutation. The rollout job's position is therefore
just a set of integers (the prompt indices it has committed, read back from its
manifest): nothing else needs saving, and a restarted job regenerates exactly
the prompts whose groups were never committed.

Rollout jobs, however many, take disjoint indices of the one stream through a shared claim
(``control/claims.py``); :class:`ClaimedPrompts` is what one writer holds and has not generated yet.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from hpcrl.config import DataConfig
from hpcrl.rollout.data import parse_row

TOY_LETTERS = "abcdefgh"


def toy_rows(num_prompts: int, answer_len: int, seed: int) -> list[dict]:
    """The toy task: "repeat c" -> "c c c c ..." (answer_len copies).

    A random tiny model scores ~1/64 per token; learning to copy the letter
    from the prompt is a few hundred GRPO updates of a 2-layer model.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        letter = rng.choice(TOY_LETTERS)
        rows.append({"prompt": f"repeat {letter}", "answer": " ".join([letter] * answer_len)})
    return rows


TOY_HELDOUT_PHRASINGS = ("repeat repeat {c}", "repeat {c} {c}", "repeat {c} .")
"""The toy task's held-out split: the same instruction in phrasings training never shows ("repeat c" is
the only one it trains on), each with every training letter."""


def toy_heldout_rows(answer_len: int) -> list[dict]:
    """The held-out split of the toy task (:data:`TOY_HELDOUT_PHRASINGS` x the letters; 24 prompts), with
    the same answer as its "repeat c". A random policy scores ~1/64 per position, a greedy random one 0;
    the tiny default run's policy copies the letter in these phrasings too (docs/validation.md)."""
    return [{"prompt": p.format(c=c), "answer": " ".join([c] * answer_len)}
            for p in TOY_HELDOUT_PHRASINGS for c in TOY_LETTERS]


def toy_calc_rows(num_prompts: int, seed: int) -> list[dict]:
    """The multi-turn toy task: "3 * 4" -> call the calculator, then answer "1 2".

    Single digits and one of + - *, in the tiny vocabulary. The reward (``toy_calc``) pays for
    trying a call, more for a call that works, most for then answering with its result."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b, op = rng.randrange(10), rng.randrange(10), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": f"{a} {op} {b}", "answer": str(value)})
    return rows


def load_rows(cfg: DataConfig, answer_len: int) -> list[dict]:
    """The prompt rows ``{prompt, answer, data_source, extra_info}`` of ``data.source``: the toy
    task (``builtin:toy``), the multi-turn toy task (``builtin:toy_calc``, tool agent rows), or a
    verl-format file (hpcrl/rollout/data.py); ValueError naming the file and row. ``builtin:toy_heldout`` is
    the toy task's held-out split (``data.val_files``)."""
    if cfg.source == "builtin:toy_heldout":
        return [dict(r, data_source="builtin:toy_heldout", extra_info=None, agent_name=None)
                for r in toy_heldout_rows(answer_len)]
    if cfg.source == "builtin:toy":
        return [dict(r, data_source="builtin:toy", extra_info=None, agent_name=None)
                for r in toy_rows(cfg.toy_num_prompts, answer_len, cfg.seed)]
    if cfg.source == "builtin:toy_calc":
        return [dict(r, data_source="builtin:toy_calc", extra_info=None, agent_name="tool_agent")
                for r in toy_calc_rows(cfg.toy_num_prompts, cfg.seed)]
    path = Path(cfg.source).expanduser()
    if not path.is_file():
        raise ValueError(f"{path} does not exist; fix: point it at a .jsonl or .parquet file on the shared filesystem "
                         "(it is read on the login node and on the rollout nodes)")
    if path.suffix == ".jsonl":
        raw = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        raw.append((f"{path}:{lineno}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
    else:
        import pandas as pd

        raw = [(f"{path} row {i}", r) for i, r in enumerate(pd.read_parquet(path).to_dict("records"))]
    if not raw:
        raise ValueError(f"{path}: no rows")
    return [parse_row(r, cfg, where) for where, r in raw]


def file_columns(source: str) -> list[str]:
    """The top-level columns of a ``.parquet`` file (its schema) or a ``.jsonl`` file (its rows' keys), for a message
    naming what the file holds; [] for the built-in data or a file that cannot be read."""
    path = Path(source).expanduser()
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        keys: dict[str, None] = {}
        with open(path) as f:
            for line in f:
                if line.strip():
                    keys.update(dict.fromkeys(json.loads(line)))
        return list(keys)
    except (OSError, ValueError, ImportError):
        return []


class PromptStream:
    """Stream index -> prompt row, one seeded permutation per epoch (see the module docstring)."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows = rows
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def __getitem__(self, index: int) -> dict:
        n = len(self.rows)
        epoch, pos = divmod(index, n)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perms = {epoch: perm}  # stream is read near-monotonically: keep one epoch
        return self.rows[int(perm[pos])]


class ClaimedPrompts:
    """The prompts this writer holds claims on and must generate before it claims new ones (in order): those its
    predecessor claimed and never committed (groups in flight when it died) and those of shards the trainer
    skipped. New prompts come from the fleet's shared claim (``control/claims.py``)."""

    def __init__(self, held: list[int]):
        self._held = sorted(set(held))

    def requeue(self, indices: list[int]) -> None:
        """Generate these again first (their shard was skipped by the trainer)."""
        self._held = sorted(set(self._held) | set(indices))

    def peek(self, most: int = 1) -> list[int]:
        """The next ``most`` held prompts, in order (fewer or none: claim new ones for the rest)."""
        return self._held[:most]

    def taken(self, index: int) -> None:
        """``index`` was admitted (held or newly claimed): not generated again from here."""
        if self._held and self._held[0] == index:
            self._held.pop(0)
