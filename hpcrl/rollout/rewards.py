"""Rule-based rewards: ``REWARDS[name](response_text, answer) -> float``.

Add one by writing a function and registering it here; ``reward.name`` in the
config picks it and is checked against this table before anything starts.
"""
from __future__ import annotations

import re
from typing import Callable

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


REWARDS: dict[str, RewardFn] = {
    "toy_copy": token_match,
    "token_match": token_match,
    "exact_match": exact_match,
    "last_number": last_number,
}
