"""Rule-based rewards: ``builtin_rule(name)(response_text, answer) -> float``.

Add one by writing a function here and its line in the registry, :data:`hpcrl.config.registries.REWARDS`;
``reward.name`` in the config picks it and is checked against that registry before anything starts. Your own
function with verl's signature goes in ``reward.path`` instead (hpcrl/rollout/reward_fn.py).

``reward.name=by_data_source`` (the default) picks the rule from each row's ``data_source``
(:data:`DATA_SOURCES`), as verl's ``default_compute_score`` picks its scorer; the same task is
checked by hpcrl's own rule (GSM8K's ``####`` answer and MATH's final answer through math-verify,
which also accepts equal answers written differently).
"""
from __future__ import annotations

import logging
import re
from typing import Callable

from hpcrl.config import registries

RewardFn = Callable[[str, str], float]


def token_match(response: str, answer: str) -> float:
    """Fraction of the answer's whitespace tokens matched position by position.
    The toy task's reward: a random policy scores ~1/vocab, a perfect one 1.0."""
    want = answer.split()
    if not want:
        return 0.0
    got = response.split()
    return sum(1 for i, w in enumerate(want) if i < len(got) and got[i] == w) / len(want)


def exact_match(response: str, answer: str) -> float:
    """1.0 if the stripped response equals the stripped answer."""
    return float(response.strip() == answer.strip())


def last_number(response: str, answer: str) -> float:
    """1.0 if the last number in the response equals the answer (GSM8K-style)."""
    nums = re.findall(r"-?\d+(?:\.\d+)?", response)
    try:
        return float(bool(nums) and float(nums[-1]) == float(answer))
    except ValueError:
        return 0.0


def _math_equal(gold: str, response: str) -> bool:
    """math-verify's answer check. Its own timeouts use signal.alarm, which works only in the
    main thread; rewards run in the rollout job's group threads, so they are off (a response is
    at most rollout.response_length tokens)."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call without timeouts
    g = parse(gold, parsing_timeout=None)
    return bool(g) and verify(g, parse(response, parsing_timeout=None), timeout_seconds=None)


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to the ground truth
    (LaTeX, fractions, ``\\boxed{}``, plain numbers), else 0.0."""
    return float(_math_equal(answer, response))


GSM8K_MARK = "####"


def gsm8k(response: str, answer: str) -> float:
    """GSM8K's convention: the response ends with ``#### <answer>``; 1.0 if the text after the
    last ``####`` equals the ground truth (checked by math-verify), 0.0 if it differs or there
    is no ``####``. A ground truth that is a full GSM8K solution is cut after its ``####`` too."""
    if GSM8K_MARK not in response:
        return 0.0
    gold = answer.rsplit(GSM8K_MARK, 1)[-1].strip()
    got = response.rsplit(GSM8K_MARK, 1)[-1].strip().replace(",", "")
    return float(_math_equal(gold.replace(",", ""), got))


def gsm8k_right_answer(answer: str) -> str:
    """The response :func:`gsm8k` scores 1 for ground truth ``answer``: ``#### <answer>``."""
    return f"{GSM8K_MARK} {answer.rsplit(GSM8K_MARK, 1)[-1].strip()}"


def toy_calc(response: str, answer: str, extra_info: dict | None) -> float:
    """The multi-turn toy task's reward (``builtin:toy_calc`` with the ``tiny`` tool parser), from
    the agent's counters in ``extra_info``: 0.3 for a call the calculator ran but rejected, 0.5 if
    it answered the call and the model then said nothing, 0.6 if it said something, 1.0 if that is
    the right number (the turn after the calculator's ``= 1 2 .``). A call that does not parse
    (``( <eos>``, empty) is no call and earns nothing, nor does a ``(`` in a turn that never ends:
    paying 0.3 for the two-token empty call made it the policy every trajectory converged to. An
    answer followed by more (another call) is no answer: paying 1.0 for it reinforced the junk
    after the number, until the first turn stopped ending. An empty answer paid like a wrong one
    (0.6) left the answer turn at the ``<eos>`` it copies from the call's turn (``( 6 <eos>``): every
    working call pushed it up, and no answer was ever tried."""
    info = extra_info or {}
    calls, errors = info.get("tool_calls", 0), info.get("tool_errors", 0)
    if not calls:
        return 0.0
    if calls <= errors:
        return 0.3
    # a call that worked has no "=" in it: the first "=" after it starts the calculator's answer
    shown = response.find("=", response.find("("))
    end = response.find(".", shown) if shown >= 0 else -1
    said = response[end + 1:].split() if end >= 0 else []
    if not said:
        return 0.5
    return 1.0 if said == list(answer.strip()) else 0.6


toy_calc.wants_extra_info = True  # the agent's counters (tool_calls, tool_errors) come in extra_info


def builtin_rule(name: str) -> RewardFn:
    """The built-in rule ``reward.name`` names (:data:`hpcrl.config.registries.REWARDS`); KeyError for another name."""
    return registries.resolve(registries.REWARDS[name])


RIGHT_ANSWERS: dict[str, Callable[[str], str]] = {"gsm8k": gsm8k_right_answer}
"""Rule -> the response it scores as right, from the ground truth, for a rule that wants a form around the answer
(every other rule takes the bare ground truth). The launch probe calls the reward on it
(:func:`hpcrl.rollout.reward_fn.probe_reward`)."""


def right_answer(rule: str | None, answer: str) -> str:
    """A response that rule ``rule`` (None: unknown) scores as right for ground truth ``answer``."""
    return RIGHT_ANSWERS[rule](answer) if rule in RIGHT_ANSWERS else answer


DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math_verify",
    "DigitalLearningGmbH/MATH-lighteval": "math_verify",
    "HuggingFaceH4/MATH-500": "math_verify",
    "math": "math_verify",
    "math_dapo": "math_verify",
    "math_dapo_reasoning": "math_verify",
    "aime*": "math_verify",
    "numina_*": "math_verify",
    "builtin:toy": "toy_copy",
    "builtin:toy_calc": "toy_calc",
    "builtin:toy_heldout": "toy_copy",
}
"""``data_source`` -> the rule of ``reward.name=by_data_source`` (verl's ``default_compute_score``
sources for GSM8K and the MATH family; a trailing ``*`` matches a prefix)."""


def scorer_for(data_source: str) -> str:
    """The rule :data:`DATA_SOURCES` gives ``data_source``; ValueError naming the known sources otherwise."""
    if data_source in DATA_SOURCES:
        return DATA_SOURCES[data_source]
    for pattern, name in DATA_SOURCES.items():
        if pattern.endswith("*") and data_source.startswith(pattern[:-1]):
            return name
    raise ValueError(f"reward.name=by_data_source has no scorer for data_source {data_source!r} (known: "
                     f"{', '.join(DATA_SOURCES)}); set reward.name to one of the built-in rules, or reward.path "
                     "to your own function")
