"""The module index at the end of ARCHITECTURE.md, written from the modules' own docstrings (as
docs/config-reference.md is written from the config's dataclasses), so that no module goes unnamed and no line of it
drifts from the code::

    python tests/module_index.py --write     # rewrite ARCHITECTURE.md's index in place

One line per module of ``hpcrl/``, by folder: its path and its docstring's first sentence. tests/test_architecture.py
fails when the index differs from what this writes now.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "hpcrl"
ARCHITECTURE = REPO / "ARCHITECTURE.md"
BEGIN = "<!-- module index: written by `python tests/module_index.py --write`; do not edit by hand -->"
END = "<!-- end of the module index -->"


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (up to the first period followed by a space or the end), whitespace joined."""
    text = " ".join(doc.split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(\s|$)", text)
    return (text[:m.start() + 1] if m else text).replace("|", "\\|")


def modules() -> list[Path]:
    """Every module of the package, a folder's ``__init__.py`` first."""
    return sorted(PKG.rglob("*.py"), key=lambda p: (p.parent.relative_to(PKG).parts, p.name != "__init__.py", p.name))


def render() -> str:
    """The index section, markers included."""
    out, folder = [BEGIN, "", "## Module index", ""], None
    for path in modules():
        rel = path.relative_to(PKG)
        if rel.parent != folder:
            folder = rel.parent
            out += ["", f"**`{'hpcrl/' + str(folder) + '/' if str(folder) != '.' else 'hpcrl/'}`**", ""]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out.append(f"- `{rel}`: {first_sentence(doc) if doc else '(no docstring)'}")
    return "\n".join(out + ["", END]) + "\n"


def written() -> str:
    """The index as ARCHITECTURE.md holds it now (empty if it has none)."""
    text = ARCHITECTURE.read_text()
    if BEGIN not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)] + "\n"


def write() -> None:
    """Replace ARCHITECTURE.md's index (or append one) with :func:`render`'s."""
    text = ARCHITECTURE.read_text()
    head = text[:text.index(BEGIN)] if BEGIN in text else text.rstrip() + "\n\n"
    ARCHITECTURE.write_text(head + render())


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        sys.stdout.write(render())
