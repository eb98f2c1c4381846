"""Records that cross a job boundary as JSON: one dataclass each, checked by type when read.

Every file or store value another job reads (heartbeats, manifests, markers, the broadcast's
header and handshake, saved trajectory states) is a dataclass deriving from :class:`JsonRecord`.
Writing is :meth:`JsonRecord.to_json` (plain ``dataclasses.asdict``); reading is
:meth:`JsonRecord.from_json`, which refuses anything that is not that record -- not a JSON
object, a required field missing, a value of the wrong type (``null`` where an int belongs, a
string for a list, ``true`` for a number) -- with :class:`RecordError` naming the record, the
field and what was found. A reader then decides what a bad record means (ignore and log it,
treat the version as damaged, ...); it never crashes deep inside on ``None.get``.

Fields a reader does not know are ignored (a newer writer may add one). Types understood: int,
float (an int is accepted), str, bool, ``Optional[X]``, ``list[X]``, ``dict[str, X]``, a nested
JsonRecord, and ``Any`` / bare ``dict`` / ``list`` (shape only).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, TypeVar

R = TypeVar("R", bound="JsonRecord")


class RecordError(ValueError):
    """A JSON value is not the record it should be (the message names the record and the field)."""


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` converted to ``hint`` (nested records built, ints widened to float); RecordError if it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, where)
            except RecordError as e:
                errors.append(str(e))
        raise RecordError(errors[-1])
    if isinstance(hint, type) and issubclass(hint, JsonRecord):
        return hint._build(value, where)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {_kind(value)}")
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_kind(value)}")
        return {k: _check(v, args[1], f"{where}.{k}") for k, v in value.items()} if args else value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
            raise RecordError(f"{where}: expected {hint.__name__}, got {_kind(value)}")
        return value
    raise TypeError(f"{where}: JsonRecord cannot check fields of type {hint!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, evaluated once per class: with postponed annotations ``typing.get_type_hints``
    evaluates every annotation string on each call (a heartbeat read took ~0.5 ms, ~20 us with the types cached;
    the jobs read records several times a second)."""
    return typing.get_type_hints(cls)


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


@dataclasses.dataclass
class JsonRecord:
    """Base of every dataclass another job reads (module docstring)."""

    def to_json(self) -> dict:
        """The record as JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls: type[R], d: Any, source: str = "") -> R:
        """The record ``d`` holds; RecordError (naming ``source``, e.g. the file, then the field and the value)
        if it is not one."""
        try:
            return cls._build(d, cls.__name__)
        except RecordError as e:
            if source:
                raise RecordError(f"{source}: {e}") from None
            raise

    @classmethod
    def _build(cls: type[R], d: Any, where: str) -> R:
        if not isinstance(d, dict):
            raise RecordError(f"{where}: expected a JSON object, got {_kind(d)}")
        hints = _hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise RecordError(f"{where}: field {f.name!r} is missing")
                continue
            kwargs[f.name] = _check(d[f.name], hints[f.name], f"{where}.{f.name}")
        record = cls(**kwargs)
        record.check()
        return record

    def check(self) -> None:
        """Rules between fields, after the types (override; raise RecordError)."""
