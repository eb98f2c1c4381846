"""Config validation helpers: every error names the key, what is allowed and the fix.

Public so that every section (and the launcher's own checks) say it the same way.
"""
from __future__ import annotations

import math
from typing import Any, Optional


class ConfigError(ValueError):
    """A config value is wrong; the message names the key, what is allowed and the fix."""


def bad(key: str, got: Any, allowed: str, fix: str = "") -> ConfigError:
    """A ConfigError saying ``config KEY: got VALUE; allowed: ...; fix: ...``."""
    msg = f"config {key}: got {got!r}; allowed: {allowed}"
    if fix:
        msg += f"; fix: {fix}"
    return ConfigError(msg)


def check_int(key: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
    """An int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, value, f"an integer >= {lo}")
    if value < lo or (hi is not None and value > hi):
        allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise bad(key, value, allowed)


def check_float(key: str, value: Any, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> None:
    """A number (not a bool, not NaN) >= lo (> lo if ``lo_open``) and <= hi."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise bad(key, value, "a number")
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise bad(key, value, f"a number {lo_s}" + ("" if hi is None else f" and <= {hi}"))


def check_choice(key: str, value: Any, choices: tuple) -> None:
    """One of ``choices``."""
    if value not in choices:
        raise bad(key, value, "one of " + ", ".join(repr(c) for c in choices))


def check_optional_choice(key: str, value: Any, choices: tuple) -> None:
    """None or one of ``choices``."""
    if value not in (None, *choices):
        raise bad(key, value, "null or one of " + ", ".join(repr(c) for c in choices))
