"""How a generative judge's text becomes a score: the built-in parsers (``reward_model.score_parser``), and a
function of your own (``FILE.py:NAME``) loaded the same way.

A parser takes the judge's decoded text and returns a number, or None when the text holds no verdict (that
response's reward is then 0, counted as a reward-model error in the rollout job's log). Add a built-in one by
writing it here and its line in :data:`hpcrl.config.registries.SCORE_PARSERS`.
"""
from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Callable, Optional

from hpcrl.config import registries

ScoreParser = Callable[[str], Optional[float]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> Optional[float]:
    """The last number in the text (so ``Score: 7/10`` gives 10: ask the judge to end with its score); None if
    there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return value if math.isfinite(value) else None


def yes_no(text: str) -> Optional[float]:
    """1.0 if the last of the words ``yes`` / ``no`` (any case) is ``yes``, 0.0 if it is ``no``; None if neither."""
    words = [w for w in re.findall(r"[a-z]+", text.lower()) if w in ("yes", "no")]
    return None if not words else float(words[-1] == "yes")


class ParserLoadError(ValueError):
    """``reward_model.score_parser`` names no function that can be loaded (one line)."""


def load_parser(spec: str) -> ScoreParser:
    """The parser ``reward_model.score_parser`` names: a built-in, or ``FILE.py:NAME`` imported from the file;
    ParserLoadError naming what is missing."""
    if spec in registries.SCORE_PARSERS:
        return registries.resolve(registries.SCORE_PARSERS[spec])
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ParserLoadError(f"reward_model.score_parser: {path} does not exist; fix: point it at a .py file on the "
                              f"shared filesystem, or use one of {', '.join(registries.SCORE_PARSERS)}")
    module_name = f"hpcrl_user_parser_{abs(hash(str(path)))}"
    spec_ = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[module_name] = module
    try:
        spec_.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - any error in the user's file is one line
        sys.modules.pop(module_name, None)
        raise ParserLoadError(f"reward_model.score_parser {path}: importing it failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ParserLoadError(f"reward_model.score_parser: {path} has no function {name!r}")
    return fn


def parse_score(parser: ScoreParser, text: str) -> tuple[Optional[float], str]:
    """(score, "") or (None, why): the parser's number, or why there is none (no verdict, an exception, junk)."""
    try:
        value = parser(text)
    except Exception as e:  # noqa: BLE001 - a user's parser must not stop the job
        return None, f"the score parser raised {type(e).__name__}: {e}"
    if value is None:
        return None, f"no score in the judge's text {text[-80:]!r}"
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None, f"the score parser returned {value!r}, not a finite number"
    return float(value), ""
