"""Config validation helpers: every error names the key, what is allowed and the fix, and one pass reports
every problem at once.

Public so that every section (and the launcher's own checks) say it the same way. A check does not raise
where a pass is collecting (:func:`collecting`): it :func:`report`s, and the checks after it still run, so
``rollout.n=0 actor.ppo_mini_batch_size=0 rollout.temperature=-3`` names all three. Outside a pass a
report raises at once (a section validated on its own). A rule that reads a value already reported wrong
asks :func:`reported` first and is skipped: it would only repeat the same mistake in other words.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Collection, Iterator, Optional


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, what is allowed and the fix (one line per problem:
    a pass raises one ConfigError holding every problem it found)."""

    key: Optional[str] = None
    """The dotted key this problem is about (set by :func:`bad`; None for a message built by hand)."""
    got: Any = None
    allowed: str = ""
    fix: str = ""


def bad(key: str, got: Any, allowed: str, fix: str = "") -> ConfigError:
    """A ConfigError saying ``config KEY: got VALUE; allowed: ...; fix: ...``."""
    msg = f"config {key}: got {got!r}; allowed: {allowed}"
    if fix:
        msg += f"; fix: {fix}"
    err = ConfigError(msg)
    err.key, err.got, err.allowed, err.fix = key, got, allowed, fix
    return err


_KEY_OF_MESSAGE = re.compile(r"config ([\w.]+)")


class Problems:
    """Every problem one pass found, in the order found: at most one per key (the first, most basic one: a
    range before a combination), and no message twice."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, err: BaseException | str) -> None:
        """Record ``err`` (a ConfigError, or any error or line: its text is the problem)."""
        if not isinstance(err, ConfigError):
            err = ConfigError(str(err).strip() or type(err).__name__)
        if err.key is not None and self.reported(err.key):
            return
        if str(err) not in (str(e) for e in self.errors):
            self.errors.append(err)

    def _keys(self) -> Iterator[str]:
        for e in self.errors:
            if e.key is not None:
                yield e.key
            else:
                yield from _KEY_OF_MESSAGE.findall(str(e).splitlines()[0])[:1]

    def reported(self, *keys: str) -> bool:
        """A problem is recorded for one of ``keys`` (one ending in ``.``: for any key under it)."""
        return any(k == key or (key.endswith(".") and k.startswith(key)) for k in self._keys() for key in keys)

    def suggest_defaults(self, defaults: dict[str, Any]) -> None:
        """Give a problem that has no fix the key's default as one (``fix: e.g. rollout.n=8, the default``)."""
        for i, e in enumerate(self.errors):
            if e.key in defaults and not e.fix and defaults[e.key] != e.got:
                shown = "null" if defaults[e.key] is None else str(defaults[e.key]).lower() \
                    if isinstance(defaults[e.key], bool) else defaults[e.key]
                self.errors[i] = bad(e.key, e.got, e.allowed, f"e.g. {e.key}={shown} (the default)")

    def error(self) -> Optional[ConfigError]:
        """One ConfigError with every problem, one line each (None if there is none)."""
        if not self.errors:
            return None
        if len(self.errors) == 1:
            return self.errors[0]
        return ConfigError("\n".join(str(e) for e in self.errors))


_PASS: ContextVar[Optional[Problems]] = ContextVar("hpcrl_config_pass", default=None)


@contextmanager
def collecting() -> Iterator[Problems]:
    """One pass that reports every problem at once: inside it :func:`report` records instead of raising, and
    the pass raises one ConfigError with every problem when it ends. A ValueError or OSError that stops the pass
    early joins the problems found before it. Nested, the outermost pass collects (so the launcher's pass holds
    the config's problems and the inputs' together)."""
    outer = _PASS.get()
    if outer is not None:
        yield outer
        return
    problems = Problems()
    token = _PASS.set(problems)
    try:
        yield problems
    except (ValueError, OSError) as e:
        if not problems.errors:
            raise
        problems.add(e)
    finally:
        _PASS.reset(token)
    err = problems.error()
    if err is not None:
        raise err


def report(err: ConfigError) -> None:
    """Record ``err`` in the pass that is collecting, or raise it when none is."""
    problems = _PASS.get()
    if problems is None:
        raise err
    problems.add(err)


def fail(key: str, got: Any, allowed: str, fix: str = "") -> bool:
    """:func:`report` the problem :func:`bad` words; False (so a check can ``return fail(...)``)."""
    report(bad(key, got, allowed, fix))
    return False


def reported(*keys: str) -> bool:
    """The pass that is collecting holds a problem for one of ``keys`` (``section.``: any key under it)."""
    problems = _PASS.get()
    return problems is not None and problems.reported(*keys)


def check_int(key: str, value: Any, lo: int, hi: Optional[int] = None) -> bool:
    """An int (not a bool) in [lo, hi]; False (reported) if not."""
    if isinstance(value, bool) or not isinstance(value, int):
        return fail(key, value, f"an integer >= {lo}")
    if value < lo or (hi is not None and value > hi):
        return fail(key, value, f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
    return True


def check_float(key: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> bool:
    """A number (not a bool, not NaN) >= lo (> lo if ``lo_open``) and <= hi; False (reported) if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return fail(key, value, "a number")
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        return fail(key, value, f"a number {lo_s}" + ("" if hi is None else f" and <= {hi}"))
    return True


def check_choice(key: str, value: Any, choices: Collection) -> bool:
    """One of ``choices`` (a tuple of names, or a registry of :mod:`hpcrl.config.registries`: its names); False
    (reported) if not."""
    if value not in choices:
        return fail(key, value, "one of " + ", ".join(repr(c) for c in choices))
    return True


def check_optional_choice(key: str, value: Any, choices: Collection) -> bool:
    """None or one of ``choices``; False (reported) if not."""
    if value not in (None, *choices):
        return fail(key, value, "null or one of " + ", ".join(repr(c) for c in choices))
    return True
