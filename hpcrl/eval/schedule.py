"""Which weight version the evaluation job evaluates next, and which due versions it gives up on.

A version is **due** if it is version 0 (``eval.before_training``), a multiple of ``eval.every_versions``, or
the final one (the trainer's ``trainer_done.json`` names it). The job *handles* each due version once: it
evaluates it, or records why not (a ``skipped`` or ``damaged`` row in ``logs/eval.jsonl``).

**Falling behind.** The job evaluates the **newest** due version that is published and not handled yet;
every older due version not handled by then is skipped (recorded, logged): either the job was busy while
it was published, or retention deleted it before the job got to it. So the job never holds more than the
one version it evaluates (pinned), never makes the trainer wait, and its curve stays current; the skipped
versions say how far behind it fell. Pure functions: the job's loop (``job.py``) reads the disk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass(frozen=True)
class DuePolicy:
    """When a version is due (module docstring)."""

    every_versions: int
    before_training: bool
    final: Optional[int] = None
    """The trainer's final version, once it is done (None before)."""

    def is_due(self, version: int) -> bool:
        """Whether ``version`` is to be evaluated."""
        if version == 0:
            return self.before_training or self.final == 0
        return (self.every_versions > 0 and version % self.every_versions == 0) or version == self.final

    def due_up_to(self, version: int) -> list[int]:
        """Every due version <= ``version``, oldest first."""
        out = [0] if self.is_due(0) and version >= 0 else []
        if self.every_versions > 0:
            out += list(range(self.every_versions, version + 1, self.every_versions))
        if self.final is not None and 0 < self.final <= version and self.final not in out:
            out.append(self.final)
        return sorted(out)


@dataclass
class Plan:
    """What to do next."""

    target: Optional[int]
    """The version to evaluate now (None: nothing due is published and not handled)."""
    skipped: list[int] = field(default_factory=list)
    """Due versions older than the target, not handled: to be recorded as skipped first."""


def plan_next(policy: DuePolicy, usable: Iterable[int], handled: Iterable[int]) -> Plan:
    """The newest due version among ``usable`` (published, not marked bad) that is not ``handled``, and the due
    versions below it that are not handled either."""
    done = set(handled)
    candidates = [v for v in usable if policy.is_due(v) and v not in done]
    if not candidates:
        return Plan(None)
    target = max(candidates)
    return Plan(target, [v for v in policy.due_up_to(target - 1) if v not in done])


def all_handled(policy: DuePolicy, handled: Iterable[int]) -> bool:
    """The trainer is done and every due version up to its final one is handled: the job's work is over."""
    if policy.final is None:
        return False
    done = set(handled)
    return all(v in done for v in policy.due_up_to(policy.final))
