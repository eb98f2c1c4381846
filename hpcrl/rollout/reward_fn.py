"""The reward function of a run: a built-in rule or your own, called the way verl calls it.

verl calls a reward function by keyword (``verl/workers/reward_manager/naive.py``)::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)

and so does hpcrl, with one kindness: only the parameters the function accepts are passed. So
verl's custom reward functions (``def compute_score(data_source, solution_str, ground_truth,
extra_info=None)``, in any order) and its per-source scorers (``verl/utils/reward_score/gsm8k.py``:
``compute_score(solution_str, ground_truth, method="strict", ...)``) both work unchanged.
``reward.kwargs`` (verl: ``custom_reward_function.reward_kwargs``) are passed as keywords too.
A function that cannot take ``solution_str`` and ``ground_truth`` by name is refused at launch
with its signature and the expected one.

``reward.path`` names the Python file and ``reward.function`` the function (verl:
``custom_reward_function.path`` / ``.name``); otherwise ``reward.name`` picks a built-in from
:data:`hpcrl.config.registries.REWARDS`, or ``by_data_source``: the built-in that a row's
``data_source`` names (:data:`hpcrl.rollout.rewards.DATA_SOURCES`), verl's
``default_compute_score`` habit over hpcrl's own scorers. A result is a number (a bool counts as
0/1, a tuple's first element is taken, as verl does) or a dict whose ``score`` is the reward and
whose other numbers become metrics of the rollout job's per-version log (``reward_extra/<key>``).

Checked before it matters: the launcher imports the file, checks the signature and calls the
function on a real row of each data source (:func:`probe_reward`: its ground truth as the response, in the
form the data source's rule wants, and as the model's tokenizer would write it), so a broken file fails before
anything is submitted; the rollout job imports it again and records an import failure as fatal (no
restart would fix it). At run time an exception in the function gives that response reward 0, is
counted (``reward/errors``, with the first message and sample id in ``reward/first_error``) and
logged; it never stops the job.
"""
from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hpcrl.config import RewardConfig
from hpcrl.config.names import BY_DATA_SOURCE
from hpcrl.reward.wire import RewardUnavailable
from hpcrl.rollout.rewards import builtin_rule, right_answer, scorer_for
from hpcrl.logs import metric_names as M

log = logging.getLogger(__name__)

ComputeScore = Callable[..., Any]
"""Called as ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **kwargs)``
with only the names it accepts; returns a number or a dict with ``score``."""

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keyword arguments verl passes to a reward function (besides ``reward_kwargs``)."""
MODEL_ARGUMENTS = ("rm_score", "reward_model")
"""What a function may take by name when ``reward_model.enable`` (hpcrl/reward/scoring.py): the model's score of this
response (fetched with its group's one request), and the model itself for calls of its own (verl's hybrid rewards
call the reward model's router; hpcrl hands a client)."""
EXPECTED = "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
"""The signature a reward function is expected to have (any subset of the names, in any order, as
long as ``solution_str`` and ``ground_truth`` are among them)."""


class RewardLoadError(ValueError):
    """The reward file cannot be imported, has no such function, or the function cannot be called as
    verl calls it (one line)."""


def _builtin(name: str) -> ComputeScore:
    if name == BY_DATA_SOURCE:
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return _call_rule(scorer_for(data_source), solution_str, ground_truth, extra_info)
    else:
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return _call_rule(name, solution_str, ground_truth, extra_info)
    compute_score.__name__ = name
    return compute_score


def _call_rule(name: str, response: str, answer: str, extra_info: Optional[dict]) -> float:
    fn = builtin_rule(name)
    return fn(response, answer, extra_info) if getattr(fn, "wants_extra_info", False) else fn(response, answer)


def _import(cfg: RewardConfig) -> Callable:
    path = Path(cfg.path).expanduser().resolve()
    if not path.is_file():
        raise RewardLoadError(f"reward.path {path} does not exist; fix: point reward.path at a .py file on the shared "
                              f"filesystem that defines {cfg.function} ({EXPECTED})")
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


class BoundReward:
    """A reward function and how it is called: the keyword arguments it accepts, plus ``reward.kwargs`` (and, with
    ``with_model``, :data:`MODEL_ARGUMENTS` it names)."""

    def __init__(self, fn: Callable, kwargs: dict, where: str, with_model: bool = False):
        self.fn = fn
        self.where = where
        """``reward.path FILE compute_score`` or ``reward.name NAME``: for messages."""
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or C function: pass everything, as verl does
            sig = None
        self.signature = f"{getattr(fn, '__name__', 'compute_score')}{sig}" if sig else repr(fn)
        params = sig.parameters.values() if sig else []
        takes_any = sig is None or any(p.kind is p.VAR_KEYWORD for p in params)
        by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [n for n in ("solution_str", "ground_truth") if n not in by_name and not takes_any]
        if missing:
            raise RewardLoadError(f"{where}: {self.signature} cannot take {' and '.join(missing)} by name; expected "
                                  f"{EXPECTED} (verl's; parameters it lacks are simply not passed)")
        model = MODEL_ARGUMENTS if with_model else ()
        offered = set(VERL_ARGUMENTS) | set(kwargs) | set(model)
        unfilled = [p.name for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD
                    and p.kind is not p.VAR_POSITIONAL and p.name not in offered]
        if unfilled:
            raise RewardLoadError(f"{where}: {self.signature} needs {', '.join(unfilled)}, which is not one of "
                                  f"{', '.join(VERL_ARGUMENTS)}; give it a default or set reward.kwargs "
                                  f"(verl: custom_reward_function.reward_kwargs)")
        unused = sorted(k for k in kwargs if k not in by_name and not takes_any)
        if unused:
            raise RewardLoadError(f"{where}: reward.kwargs {', '.join(unused)} are not parameters of "
                                  f"{self.signature}; remove them or add the parameters")
        self.passed = tuple(n for n in (*VERL_ARGUMENTS, *kwargs) if takes_any or n in by_name) + tuple(
            n for n in model if n in by_name)
        """The names passed on each call (the model's only when named: a ``**kwargs`` function is not sent them)."""
        self.kwargs = dict(kwargs)

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict],
                 rm_score: Optional[float] = None, reward_model: Any = None) -> Any:
        offered = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                   "extra_info": extra_info, "rm_score": rm_score, "reward_model": reward_model, **self.kwargs}
        return self.fn(**{k: offered[k] for k in self.passed})


def model_score(solution_str, ground_truth, rm_score=None):
    """The reward of ``reward_model.enable`` without ``reward.path``: the reward model's score (verl's rule)."""
    if rm_score is None:
        raise ValueError("the reward model gave no score for this response (reward_model/first_problem says why)")
    return rm_score


def load_reward(cfg: RewardConfig, with_model: bool = False) -> BoundReward:
    """The run's reward, ready to call: the user's function from reward.path, or the built-in reward.name, or (with
    ``with_model``, ``reward_model.enable``, and no reward.path) the reward model's score; RewardLoadError (one line)
    if it cannot be imported or called as verl calls it."""
    if cfg.path is None and with_model:
        return BoundReward(model_score, {}, "reward_model (its score)", with_model=True)
    if cfg.path is None:
        return BoundReward(_builtin(cfg.name), cfg.kwargs, f"reward.name {cfg.name}")
    return BoundReward(_import(cfg), cfg.kwargs, f"reward.path {cfg.path} {cfg.function}", with_model)


def split_result(result: Any) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) of what compute_score returned; ValueError if it is neither a
    number (a bool counts, a tuple's first element is taken: verl's rules) nor a dict with a numeric ``score``."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(result)})")
        extra = {str(k): float(v) for k, v in result.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        result = result["score"]
    else:
        extra = {}
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    if hasattr(result, "item") and callable(result.item):  # numpy / torch scalars
        result = result.item()
    if not isinstance(result, (int, float)) or math.isnan(float(result)):
        raise ValueError(f"returned {result!r}, not a number (or a dict with a numeric 'score')")
    return float(result), extra


def result_fields(result: Any) -> dict[str, Any]:
    """The fields of a dict result whose values are JSON scalars (str, finite number, bool, null); {} for a number."""
    if not isinstance(result, dict):
        return {}
    return {str(k): v for k, v in result.items()
            if v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v)}


@dataclass
class RewardProbe:
    """What the launch probe (:func:`probe_reward`) found."""

    line: str
    """``reward: ..., called with ...; ... openai/gsm8k '#### 72' -> 1``: for the user."""
    unwritable: list[str] = field(default_factory=list)
    """One phrase per data source whose right answer scores less as the model's tokenizer writes it (the model
    can never write it: e.g. ``####`` and the numbers are unknown words of the tiny tokenizer)."""
    metrics: set[str] = field(default_factory=set)
    """The metrics every data source's result offers (verl's DAPO manager's names: ``acc`` and ``score`` for a
    number, a dict's keys), what ``algorithm.filter_groups.metric`` may name besides the reward."""


def rule_of(cfg: RewardConfig, data_source: str) -> Optional[str]:
    """The built-in rule that scores ``data_source``'s rows: ``reward.name``'s, ``by_data_source``'s pick, or for
    a function of your own the rule its data source would get (its form of a right answer); None if unknown."""
    if cfg.path is None and cfg.name != BY_DATA_SOURCE:
        return cfg.name
    try:
        return scorer_for(data_source)
    except ValueError:
        return None


def probe_reward(cfg: RewardConfig, rows: list[dict], tokenizer=None) -> RewardProbe:
    """Import the reward, check its signature and call it on the first row of each data source with a right
    answer as the response (the ground truth, in the form the data source's rule wants: ``#### 72`` for
    gsm8k); with ``tokenizer``, also on that answer as the model would write it (encoded and decoded as the
    rollout job decodes). RewardLoadError in one line if a call fails."""
    fn = load_reward(cfg)
    first: dict[str, dict] = {}
    for row in rows:
        first.setdefault(row["data_source"], row)
    scores, unwritable, zero, metrics = [], [], False, None
    for source, row in first.items():
        response = right_answer(rule_of(cfg, source), row["answer"])
        score, extra, keys = _probe_one(fn, row, response)
        metrics = keys if metrics is None else metrics & keys
        shown = f"{source or '(no data_source)'} {response[:30]!r} -> {score:g}"
        if tokenizer is not None:
            ids = tokenizer(response, add_special_tokens=False)["input_ids"]
            written = tokenizer.decode(ids, skip_special_tokens=True)
            written_score = _probe_one(fn, row, written)[0] if written != response else score
            if written_score < score:
                tokens = tokenizer.decode(ids, skip_special_tokens=False)
                how = f"{written[:30]!r}" + (f" (tokens {tokens[:30]!r})" if tokens != written else "")
                shown += f", but as the model's tokenizer writes it {how} -> {written_score:g}"
                unwritable.append(f"{source or '(no data_source)'}: {response[:30]!r} is written {how}")
        zero = zero or score == 0
        scores.append(shown + (f" + metrics {sorted(extra)}" if extra else ""))
    what = f"{fn.signature} from {cfg.path}" if cfg.path else f"built-in {cfg.name}"
    line = (f"reward: {what}, called with {', '.join(fn.passed)}; a real row of each data source, its ground truth "
            f"as the response (in the form its data source's rule wants): {'; '.join(scores[:4])}"
            + (f" (+{len(scores) - 4} more sources)" if len(scores) > 4 else ""))
    if zero and cfg.path is not None:
        line += ("; a 0 here is no error by itself: the probe cannot know the form your function wants around the "
                 "answer, and a form it does not accept scores 0")
    elif zero:
        line += ("; a 0 here: the rule does not take the ground truth alone as a right answer (it needs more, as "
                 "toy_calc needs the agent's tool calls, or it was written for other rows)")
    return RewardProbe(line, unwritable, metrics or set())


def _probe_one(fn: BoundReward, row: dict, response: str) -> tuple[float, dict[str, float], set[str]]:
    """(score, numeric extras, the metrics the result offers: ``acc`` and ``score`` for a number, a dict's keys
    whose values are numbers or booleans)."""
    try:
        result = fn(row["data_source"], response, row["answer"], row["extra_info"])
        score, extra = split_result(result)
        if not isinstance(result, dict):
            return score, extra, {"acc", "score"}
        return score, extra, {k for k, v in result_fields(result).items() if isinstance(v, (bool, int, float))}
    except Exception as e:  # noqa: BLE001 - reported in one line, before submission
        raise RewardLoadError(f"{fn.where} failed on the first row of data_source {row['data_source']!r} (its "
                              f"ground truth {response[:40]!r} as the response): {type(e).__name__}: {e}") from None


def check_reward(cfg: RewardConfig, rows: list[dict], tokenizer=None) -> str:
    """:func:`probe_reward`'s line."""
    return probe_reward(cfg, rows, tokenizer).line


class RewardScorer:
    """Calls the reward for the rollout job's group threads; counts failures (with the first one's message
    and sample id) and the extra metrics. ``model``: the reward model (``hpcrl/reward/scoring.py``), asked for a
    group's scores in one request when the reward needs them (``rm_score``)."""

    def __init__(self, fn: ComputeScore, model: Any = None):
        self.fn = fn
        self.model = model
        self._lock = threading.Lock()
        self._errors = 0
        self._first_error = ""
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)
        self.waiting = 0
        """Groups in :meth:`score_group` now (the rollout job's generating count leaves them out)."""

    def score(self, sample_id: str, row: dict, response: str, agent_info: Optional[dict] = None) -> float:
        """The reward of one response; 0.0 (counted and logged) if the function raises or returns junk.
        A tool agent's counters (``num_turns``, ``tool_calls``, ``tool_errors``) join ``extra_info``."""
        return self.score_full(sample_id, row, response, agent_info)[0]

    def score_group(self, sample_ids: list[str], row: dict, responses: list[tuple[list[int], str]],
                    agent_infos: list[Optional[dict]], stop: Callable[[], bool] = lambda: False
                    ) -> list[tuple[float, dict[str, Any]]]:
        """:meth:`score_full` of each ``(tokens, text)`` response of one group, the reward model's scores fetched
        first in one request when the reward takes them (``stop``: the job is stopping; a wait for a reward job then
        ends with RewardWaitStopped)."""
        passed = getattr(self.fn, "passed", ())
        scores = [None] * len(responses)
        with self._lock:
            self.waiting += 1
        try:
            if self.model is not None and "rm_score" in passed:
                scores = self.model.group_scores(row, responses, f"scoring {sample_ids[0].rpartition('/')[0]}", stop)
            handle = self.model.handle(row, stop) if self.model is not None and "reward_model" in passed else None
            return [self.score_full(sid, row, text, info, rm_score, handle)
                    for sid, (_, text), info, rm_score in zip(sample_ids, responses, agent_infos, scores)]
        finally:
            with self._lock:
                self.waiting -= 1

    def score_full(self, sample_id: str, row: dict, response: str, agent_info: Optional[dict] = None,
                   rm_score: Optional[float] = None, reward_model: Any = None) -> tuple[float, dict[str, Any]]:
        """:meth:`score` and the fields of a dict result (``score`` included, as verl records them): every JSON
        scalar (numbers, and strings such as verl's ``pred``, which the evaluation's majority vote reads);
        ``(0.0, {})`` on failure."""
        extra_info = row["extra_info"] if not agent_info else {**(row["extra_info"] or {}), **agent_info}
        try:
            if rm_score is None and reward_model is None:  # a reward of its own: called as verl calls it
                result = self.fn(row["data_source"], response, row["answer"], extra_info)
            else:
                result = self.fn(row["data_source"], response, row["answer"], extra_info, rm_score, reward_model)
            reward, extra = split_result(result)
        except RewardUnavailable:
            raise  # no reward job answered: this group is not scored (never a 0 in its place)
        except Exception as e:  # noqa: BLE001 - a user's function must not stop the job
            message = f"{sample_id}: {type(e).__name__}: {e}"
            with self._lock:
                self._errors += 1
                self._first_error = self._first_error or " ".join(message.split())[:300]
            log.warning("reward function failed on sample %s (reward 0): %s: %s", sample_id, type(e).__name__, e)
            return 0.0, {}
        if extra:
            with self._lock:
                for k, v in extra.items():
                    self._sums[k] += v
                    self._counts[k] += 1
        return reward, result_fields(result)

    def note(self, values: dict[str, float]) -> None:
        """Count ``values`` with the function's own extra metrics (``reward_extra/<key>`` means), e.g. the overlong
        penalty that ``rollout/shaping.py`` adds."""
        with self._lock:
            for k, v in values.items():
                self._sums[k] += v
                self._counts[k] += 1

    def pop_metrics(self) -> dict[str, Any]:
        """``reward/errors`` (and the first one, ``reward/first_error``) and ``reward_extra/<key>`` means since
        the last call (one version's row)."""
        with self._lock:
            out: dict[str, Any] = {M.REWARD_ERRORS: self._errors}
            if self._first_error:
                out[M.REWARD_FIRST_ERROR] = self._first_error
            out.update({M.REWARD_EXTRA_PREFIX + k: self._sums[k] / self._counts[k] for k in self._sums})
            if self.model is not None:
                out.update(self.model.pop_metrics())
            self._errors = 0
            self._first_error = ""
            self._sums.clear()
            self._counts.clear()
        return out
