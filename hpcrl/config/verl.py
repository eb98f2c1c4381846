"""verl's config keys read as hpcrl's: a verl user's YAML file and ``key=value`` overrides work unchanged.

The table is :data:`hpcrl.config.verl_keys.VERL_KEYS` (one entry per verl key or ``prefix.*``); this module
applies it where :func:`hpcrl.config.run.load_config` builds the tree, before the dataclasses are built:

1. the YAML file and the overrides become leaves (``actor_rollout_ref.rollout.n`` = 8), overrides last,
   a Hydra ``+key=value`` read as ``key=value``;
2. a leaf hpcrl knows is taken as it is; else its table entry says which hpcrl key takes the value
   (logged once per entry: ``actor_rollout_ref.rollout.n -> rollout.n``), or that it has no meaning here
   (accepted with one line saying what hpcrl does instead), or refuses it with the reason;
3. values whose units differ are converted once every leaf is read (:mod:`hpcrl.config.verl_units`: verl's
   micro-batches count sequences, hpcrl's groups; ``data.train_batch_size`` becomes
   ``async_training.require_batches``; GPUs per node become ranks ...), each saying what it made;
4. every unknown key, refused key and conflict is reported together, one line each; an unknown key
   gets the nearest hpcrl or verl key (``did you mean ...?``).

Two file keys that set the same hpcrl key to different values are a conflict; an override wins over
the file.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.config.checks import ConfigError, bad, collecting, report
from hpcrl.config.names import RENAMED_KEYS
from hpcrl.config.verl_keys import VERL_KEYS, VerlKey
from hpcrl.config.verl_units import CONVERSIONS, LATE, PAIRED, conversion

WILDCARD = ".*"


def entry_of(key: str) -> tuple[Optional[str], Optional[VerlKey]]:
    """(the table key that covers ``key``, its entry as a VerlKey); (None, None) if none does."""
    if key in VERL_KEYS:
        return key, _as_entry(VERL_KEYS[key])
    best = None
    for k in VERL_KEYS:
        if k.endswith(WILDCARD) and (key + ".").startswith(k[:-1]) and (best is None or len(k) > len(best)):
            best = k
    return (best, _as_entry(VERL_KEYS[best])) if best else (None, None)


def _as_entry(value: str | tuple) -> VerlKey:
    """A table value as a VerlKey: a plain string is the target; a tuple ``(target, note[, refuse])`` reads as one."""
    return VerlKey(value) if isinstance(value, str) else VerlKey(*value)


def _target(table_key: str, entry: VerlKey, key: str) -> Optional[str]:
    """The hpcrl key for ``key`` under ``table_key`` (a ``.*`` target keeps the rest of the key)."""
    if entry.target is None or not entry.target.endswith(WILDCARD):
        return entry.target
    return entry.target[:-1] + key[len(table_key) - 1:]


def _asks(value: Any) -> bool:
    """A value that asks for something (not false, null, 0 or empty)."""
    return value not in (None, False, 0, "", [], {}) and value != -1


# ---- the hpcrl side: which dotted keys exist

@dataclass
class Schema:
    """The dotted keys of the config dataclasses: leaves, the dict-typed ones (free keys below them), sections."""

    leaves: set[str] = field(default_factory=set)
    mappings: set[str] = field(default_factory=set)
    sections: dict[str, list[str]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, root: type) -> "Schema":
        s = cls()
        s._walk(root, "")
        return s

    def _walk(self, dc: type, prefix: str) -> None:
        hints = typing.get_type_hints(dc)
        instance = dc()
        self.sections[prefix] = [f.name for f in dataclasses.fields(dc)]
        for f in dataclasses.fields(dc):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                self._walk(hints[f.name], key)
                continue
            self.leaves.add(key)
            self.defaults[key] = getattr(instance, f.name)
            if hints[f.name] is dict or typing.get_origin(hints[f.name]) is dict:
                self.mappings.add(key)

    def knows(self, key: str) -> bool:
        """An hpcrl leaf, or a key inside a dict-typed field."""
        return key in self.leaves or any(key.startswith(m + ".") for m in self.mappings)

    def stops_at(self, key: str) -> bool:
        """A dict value at ``key`` is one value (not a subtree to read key by key)."""
        return key in self.leaves or key in VERL_KEYS


# ---- reading: leaves, assignments, notes

@dataclass
class _Set:
    value: Any
    by: str
    """The key as the user wrote it."""
    override: bool


class Translation:
    """The leaves of one config read through the table: hpcrl assignments, notes and problems."""

    def __init__(self, schema: Schema):
        self.schema = schema
        self.values: dict[str, _Set] = {}
        self.errors: list[str] = []
        self.used: dict[str, list[str]] = {}
        """Table key -> the user's keys it covered (one note each, in first-use order)."""
        self.notes: list[str] = []
        self.deferred: list[tuple[str, str, Any, bool]] = []
        """(table key, user's key, value, from an override): converted once every leaf is read."""

    def get(self, key: str) -> Any:
        """The value hpcrl key ``key`` has so far (its default if nothing set it)."""
        return self.values[key].value if key in self.values else self.schema.defaults.get(key)

    def assign(self, key: str, value: Any, by: str, override: bool) -> None:
        """Set hpcrl key ``key`` (written as ``by``): two file keys that disagree conflict, an override wins."""
        old = self.values.get(key)
        if old is not None and not override and not old.override and old.value != value:
            self.errors.append(f"config {by}: got {value!r}, but {old.by} already set {key} to {old.value!r}; "
                               f"fix: keep one of them")
            return
        if old is not None and old.override and not override:
            return  # an override wins over the file, whatever order they are read in
        self.values[key] = _Set(value, by, override)

    def read(self, key: str, value: Any, override: bool) -> None:
        """One leaf (module docstring, step 2)."""
        if self.schema.knows(key):
            return self.assign(key, value, key, override)
        if key.rsplit(".", 1)[-1] == "_target_" or (isinstance(value, str) and value.startswith("${")):
            what = "hydra's _target_ class paths" if key.endswith("_target_") else "verl's ${...} interpolations"
            return self._use(what, key)
        if key in RENAMED_KEYS:
            new, how = RENAMED_KEYS[key]
            self.errors.append(str(bad(key, value, f"{new} (renamed)", f"write {new} ({how})")))
            return
        table_key, entry = entry_of(key)
        if entry is None:
            self.errors.append(unknown_key_message(key, value, self.schema))
        elif entry.keys and key[len(table_key) - 1:].split(".")[0] not in entry.keys:
            self.errors.append(unlisted_key_message(key, value, table_key, entry))
        elif table_key in CONVERSIONS or (table_key.endswith("megatron.*") and key.endswith("parallel_size")):
            self.deferred.append((table_key, key, value, override))
        elif entry.refuse and _asks(value):
            self.errors.append(f"config {key}: got {value!r}; not offered here: {entry.note}")
        elif entry.target is None or entry.refuse:
            self._use(table_key, key)
        else:
            target = _target(table_key, entry, key)
            if not self.schema.knows(target):
                message = unknown_key_message(target, value, self.schema)
                self.errors.append(message.replace(f"config {target}:", f"config {key} (read as {target}):", 1))
                return
            self._use(table_key, key)
            self.assign(target, value, key, override)

    def note_of(self, key: str) -> str:
        """The table's note for ``key`` (what hpcrl does instead), for a conversion's refusal."""
        entry = entry_of(key)[1]
        return entry.note if entry is not None else ""

    def _use(self, table_key: str, key: str) -> None:
        self.used.setdefault(table_key, [])
        if key not in self.used[table_key]:
            self.used[table_key].append(key)

    def convert(self) -> None:
        """Step 3: the deferred leaves, through their conversion."""
        done: set[str] = set()
        for table_key, key, value, override in sorted(self.deferred, key=lambda d: LATE.index(conversion(d[0]))
                                                      if conversion(d[0]) in LATE else -1):
            fn = conversion(table_key)
            if fn in PAIRED and fn.__name__ in done:
                continue
            done.add(fn.__name__)
            try:
                made, note = fn(value, self, key)
            except ConfigError as e:
                self.errors.append(str(e))
                continue
            for k, v in made:
                old = self.values.get(k)
                if old is not None and old.by != key and old.value != v:
                    if old.override and not override:
                        continue  # an override wins over the file
                    if not override or old.override:
                        self.errors.append(f"config {key}: makes {k}={v!r}, but {old.by} set it to {old.value!r}; "
                                           "fix: keep one of them")
                        continue
                self.values[k] = _Set(v, key, override)
            self.notes.append(f"verl {key}={value!r}: {note}")

    def note_lines(self) -> list[str]:
        """One line per table entry used (module docstring, step 2), then the conversions."""
        out = []
        for table_key, keys in self.used.items():
            entry = _as_entry(VERL_KEYS[table_key]) if table_key in VERL_KEYS else None
            shown = ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
            if entry is None:
                out.append(f"verl {shown}: not read ({table_key}: hpcrl keeps one value per key)")
            elif entry.target is not None and not entry.refuse:
                target = _target(table_key, entry, keys[0]) if len(keys) == 1 else entry.target
                out.append(f"verl {shown} -> {target}" + (f" ({entry.note})" if entry.note else ""))
            else:
                out.append(f"verl {shown}: not used here: {entry.note}")
        return out + self.notes

    def tree(self) -> dict:
        """The assignments as a nested tree of hpcrl keys."""
        out: dict = {}
        for key, s in self.values.items():
            node = out
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = s.value
        return out


def leaves(tree: Any, prefix: str, schema: Schema) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a YAML tree (step 1): a dict is read key by key unless hpcrl or
    the table takes it as one value."""
    if isinstance(tree, dict) and not tree and prefix in schema.sections:
        return []  # an empty section: nothing set
    if not isinstance(tree, dict) or not tree or (prefix and schema.stops_at(prefix)):
        return [(prefix, tree)]
    out = []
    for k, v in tree.items():
        out += leaves(v, f"{prefix}.{k}" if prefix else str(k), schema)
    return out


def translate(tree: dict, overrides: list[tuple[str, Any]], root: type) -> tuple[dict, list[str]]:
    """The hpcrl tree of a YAML tree and ``key=value`` overrides (module docstring) and the lines saying how
    verl's keys were read; ConfigError with one line per problem."""
    schema = Schema.of(root)
    t = Translation(schema)
    for key, value in leaves(tree, "", schema):
        t.read(key, value, override=False)
    for key, value in overrides:
        for k, v in leaves(value, key, schema) if isinstance(value, dict) and key in schema.sections else [(key, value)]:
            t.read(k, v, override=True)
    t.convert()
    with collecting():  # in the caller's pass, the tree without the keys in error goes on to be checked
        for line in dict.fromkeys(t.errors):
            report(ConfigError(line))
    return t.tree(), t.note_lines()


# ---- unknown keys: what is near

def _candidates(schema: Schema) -> list[str]:
    return sorted(schema.leaves | {k for k in VERL_KEYS if not k.endswith(WILDCARD)})


def unlisted_key_message(key: str, value: Any, table_key: str, entry: VerlKey) -> str:
    """A key under a ``.*`` entry that lists verl's keys there (``VerlKey.keys``), not one of them: ``config
    actor_rollout_ref.actor.optim.lrr: got ...; allowed: verl's keys of ...; fix: did you mean ...?``."""
    prefix = table_key[:-len(WILDCARD)]
    siblings = [f"{prefix}.{k}" for k in entry.keys]
    near = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if near:
        target = entry_of(near[0])[1]
        read_as = f" (verl's name, read as {target.target})" if target and target.target else ""
        fix = f"did you mean {near[0]}{read_as}?"
    else:
        fix = f"check the spelling against verl's {prefix} keys"
    return str(bad(key, value, f"verl's keys of {prefix}: {', '.join(entry.keys)}", fix))


def unknown_key_message(key: str, value: Any, schema: Schema) -> str:
    """``config KEY: got V; allowed: ...; fix: did you mean ...?`` with the nearest hpcrl or verl key."""
    parts = key.split(".")
    section = ""
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in schema.sections:
            section = ".".join(parts[:i])
            break
    known = schema.sections.get(section, [])
    allowed = (f"the keys of {section}: {', '.join(known)}" if section else f"the sections {', '.join(known)}") + \
        ", or verl's names for them (docs/verl.md)"
    near = difflib.get_close_matches(key, _candidates(schema), n=1, cutoff=0.75)
    if not near:  # the first unknown part, at its own level
        level = schema.sections.get(section, [])
        part = parts[len(section.split(".")) if section else 0]
        close = difflib.get_close_matches(part, level, n=1, cutoff=0.6)
        near = [f"{section + '.' if section else ''}{close[0]}"] if close else []
    if near:
        table_key, entry = entry_of(near[0])
        read_as = f" (verl's name, read as {_target(table_key, entry, near[0])})" if entry and entry.target else ""
        fix = f"did you mean {near[0]}{read_as}?"
    else:
        fix = f"check the spelling against hpcrl/config/ ({section or 'the top level'}) or verl's key table"
    return str(bad(key, value, allowed, fix))
