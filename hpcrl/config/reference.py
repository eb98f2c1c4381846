"""The configuration reference (``docs/config-reference.md``), made from the config's own dataclasses: every key,
its default and the docstring under its field, so that the reference cannot drift from the code
(``tests/test_docs.py`` fails when the file differs from what this module writes now)::

    python -m hpcrl.config.reference > docs/config-reference.md
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing

from hpcrl.config import registries
from hpcrl.config.run import RunConfig

HEAD = """# Configuration reference

Every key of a run's config, its default and what it means, section by section. Written from the config's own
dataclasses (`python -m hpcrl.config.reference > docs/config-reference.md`; a test fails when this page is older
than the code). A config is a YAML file (`configs/*.yaml`) plus `key=value` overrides; verl's keys are read too
([Coming from verl](verl.md)); everything is checked before anything is submitted, every problem in one pass.
What may change on `hpcrl run --resume`: [Launching](launching.md).
"""


LISTED = {"rollout.engine": registries.ENGINES, "algorithm.adv_estimator": registries.ADV_ESTIMATORS,
          "weights.transport": registries.WEIGHT_TRANSPORTS}
"""Keys whose allowed names are listed from their registry, each with its entry's ``doc`` (so the list a field's
docstring would hold cannot miss a name added to the registry)."""


def listed(key: str) -> str:
    """``key``'s names and what each is, from its registry (empty for a key not in :data:`LISTED`)."""
    registry = LISTED.get(key)
    if registry is None:
        return ""
    return " One of: " + "; ".join(f"``{name}``: {entry.doc}" for name, entry in registry.items()) + "."


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string right after its annotated assignment)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            out[a.target.id] = " ".join(b.value.value.split())
    return out


def _section(hint: typing.Any) -> typing.Optional[type]:
    """The dataclass a field's type is (or holds, for Optional), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`" if value is not None else "`null`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _render(cls: type, prefix: str, level: int, out: list[str]) -> None:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out += [f"{'#' * level} `{prefix}`", "", " ".join((inspect.getdoc(cls) or "").split()), "",
            "| key | default | meaning |", "|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        section = _section(hints[f.name])
        if section is not None and f.default_factory is not dataclasses.MISSING:
            nested.append((section, f"{prefix}.{f.name}"))
            continue
        key = f"{prefix}.{f.name}"
        out.append(f"| `{key}` | {_cell(_default(f))} | {_cell(docs.get(f.name, '') + listed(key))} |")
    out.append("")
    for section, key in nested:
        _render(section, key, min(level + 1, 4), out)


def render() -> str:
    """The whole reference page."""
    out = [HEAD]
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        section = _section(hints[f.name])
        if section is not None:
            _render(section, f.name, 2, out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
