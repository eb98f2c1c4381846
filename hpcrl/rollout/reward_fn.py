"""The reward function of a run: a built-in rule or your own, with verl's signature.

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

``reward.path`` names the Python file and ``reward.function`` the function (verl:
``custom_reward_function.path`` / ``.name``); otherwise ``reward.name`` picks a built-in
from :data:`hpcrl.rollout.rewards.REWARDS`. A dict result's ``score`` is the reward and its
other numbers become metrics of the rollout job's per-version log (``reward_extra/<key>``,
the mean over the version's responses).

Checked twice before it matters: the launcher imports the file and calls the function on
the first prompt (:func:`check_reward`), so a broken file fails before anything is
submitted; the rollout job imports it again and records an import failure as fatal (no
restart would fix it). At run time an exception in the function gives that response
reward 0, is counted (``reward/errors``) and logged with the sample id; it never stops the job.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

from hpcrl.config import RewardConfig
from hpcrl.rollout.rewards import REWARDS
from hpcrl import metric_names as M

log = logging.getLogger(__name__)

ComputeScore = Callable[..., Any]
"""``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``."""


class RewardLoadError(ValueError):
    """The reward file cannot be imported, or has no such function (one line)."""


def _builtin(name: str) -> ComputeScore:
    fn = REWARDS[name]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if getattr(fn, "wants_extra_info", False):
            return fn(solution_str, ground_truth, extra_info)
        return fn(solution_str, ground_truth)

    compute_score.__name__ = name
    return compute_score


def load_reward(cfg: RewardConfig) -> ComputeScore:
    """The run's ``compute_score``: the user's function from reward.path, or the built-in reward.name."""
    if cfg.path is None:
        return _builtin(cfg.name)
    path = Path(cfg.path).expanduser().resolve()
    if not path.is_file():
        raise RewardLoadError(f"reward.path {path} does not exist")
    name = f"hpcrl_user_reward_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling inside the user's file need it
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - any error in the user's file is reported in one line
        sys.modules.pop(name, None)
        raise RewardLoadError(f"reward.path {path}: importing it failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, cfg.function, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardLoadError(f"reward.path {path} has no function {cfg.function!r} (reward.function); "
                              f"functions there: {', '.join(found) or 'none'}")
    return fn


def split_result(result: Any) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) of what compute_score returned; ValueError if it is neither a
    number nor a dict with a numeric ``score``."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(result)})")
        extra = {str(k): float(v) for k, v in result.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        result = result["score"]
    else:
        extra = {}
    if isinstance(result, bool) or not isinstance(result, (int, float)) or math.isnan(float(result)):
        raise ValueError(f"returned {result!r}, not a number (or a dict with a numeric 'score')")
    return float(result), extra


def result_fields(result: Any) -> dict[str, Any]:
    """The fields of a dict result whose values are JSON scalars (str, finite number, bool, null); {} for a number."""
    if not isinstance(result, dict):
        return {}
    return {str(k): v for k, v in result.items()
            if v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v)}


def check_reward(cfg: RewardConfig, row: dict) -> str:
    """Import the reward and call it once on ``row`` (with its ground truth as the response);
    ValueError in one line if that fails. Returns a line describing the reward."""
    fn = load_reward(cfg)
    try:
        score, extra = split_result(fn(row["data_source"], row["answer"], row["answer"], row["extra_info"]))
    except Exception as e:  # noqa: BLE001 - reported in one line, before submission
        where = f"reward.path {cfg.path} {cfg.function}" if cfg.path else f"reward.name {cfg.name}"
        raise RewardLoadError(f"{where} failed on the first prompt: {type(e).__name__}: {e}") from None
    what = f"{cfg.function} from {cfg.path}" if cfg.path else f"built-in {cfg.name}"
    return f"reward: {what} (first prompt, its ground truth as the response: {score:g}" + \
        (f", metrics {sorted(extra)})" if extra else ")")


class RewardScorer:
    """Calls compute_score for the rollout job's group threads; counts failures and the extra metrics."""

    def __init__(self, fn: ComputeScore):
        self.fn = fn
        self._lock = threading.Lock()
        self._errors = 0
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def score(self, sample_id: str, row: dict, response: str, agent_info: Optional[dict] = None) -> float:
        """The reward of one response; 0.0 (counted and logged) if the function raises or returns junk.
        A tool agent's counters (``num_turns``, ``tool_calls``, ``tool_errors``) join ``extra_info``."""
        return self.score_full(sample_id, row, response, agent_info)[0]

    def score_full(self, sample_id: str, row: dict, response: str,
                   agent_info: Optional[dict] = None) -> tuple[float, dict[str, Any]]:
        """:meth:`score` and the fields of a dict result (``score`` included, as verl records them): every JSON
        scalar (numbers, and strings such as verl's ``pred``, which the evaluation's majority vote reads);
        ``(0.0, {})`` on failure."""
        extra_info = row["extra_info"] if not agent_info else {**(row["extra_info"] or {}), **agent_info}
        try:
            result = self.fn(row["data_source"], response, row["answer"], extra_info)
            reward, extra = split_result(result)
        except Exception as e:  # noqa: BLE001 - a user's function must not stop the job
            with self._lock:
                self._errors += 1
            log.warning("reward function failed on sample %s (reward 0): %s: %s", sample_id, type(e).__name__, e)
            return 0.0, {}
        if extra:
            with self._lock:
                for k, v in extra.items():
                    self._sums[k] += v
                    self._counts[k] += 1
        return reward, result_fields(result)

    def pop_metrics(self) -> dict[str, float]:
        """``reward/errors`` and ``reward_extra/<key>`` means since the last call (one version's row)."""
        with self._lock:
            out: dict[str, float] = {M.REWARD_ERRORS: self._errors}
            out.update({M.REWARD_EXTRA_PREFIX + k: self._sums[k] / self._counts[k] for k in self._sums})
            self._errors = 0
            self._sums.clear()
            self._counts.clear()
        return out

