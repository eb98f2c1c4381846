"""ARCHITECTURE.md stays a true map: at most 250 lines before its module index, the index the one
tests/module_index.py writes now from the modules' docstrings (every module of hpcrl/ named), and every code file and
``file.py:Symbol`` it names exists."""
from __future__ import annotations

import ast
import re

import module_index
from module_index import ARCHITECTURE, BEGIN, PKG, REPO

HAND_WRITTEN_MAX_LINES = 250

CODE_REF = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.py)(?::\s?([\w.]+))?`")
"""A code file named in backticks, with a symbol after a colon if any: ``trainer/update.py:PolicyUpdate.run``."""


def hand_written() -> str:
    text = ARCHITECTURE.read_text()
    return text[:text.index(BEGIN)]


def test_the_map_is_short_and_its_index_is_the_one_the_code_writes_now():
    assert len(hand_written().splitlines()) <= HAND_WRITTEN_MAX_LINES, "ARCHITECTURE.md is a map, not an inventory"
    assert module_index.written() == module_index.render(), (
        "ARCHITECTURE.md's module index is older than the modules' docstrings: python tests/module_index.py --write")


def test_every_module_is_named_in_the_index():
    index = module_index.written()
    unnamed = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if f"- `{p.relative_to(PKG)}`: " not in index]
    assert not unnamed, unnamed


def _file(ref: str):
    """The file a reference names: a path under the repository (tests/, bench/, ...), else under hpcrl/."""
    for base in (REPO, PKG):
        if (base / ref).is_file():
            return base / ref
    return None


def _defines(path, symbol: str) -> bool:
    """``symbol`` (``Name`` or ``Class.attribute``) is defined at the top of the module (or in the class)."""
    body = ast.parse(path.read_text()).body
    for part in symbol.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def stale_references(text: str) -> list[str]:
    """Each ``file.py`` or ``file.py:Symbol`` of ``text`` that does not exist."""
    stale = []
    for ref, symbol in CODE_REF.findall(text):
        path = _file(ref)
        if path is None:
            stale.append(f"{ref} (no such file)")
        elif symbol and not _defines(path, symbol):
            stale.append(f"{ref}:{symbol} (no such symbol)")
    return stale


def test_every_file_and_symbol_the_map_names_exists():
    assert CODE_REF.findall(hand_written()), "the search finds the map's references"
    stale = stale_references(hand_written())
    assert not stale, "ARCHITECTURE.md names what is not there:\n" + "\n".join(stale)


def test_the_reference_check_finds_what_is_gone():
    assert stale_references("`trainer/main.py:TrainerJob.run` and `weights/filesystem.py` and `run_dir.py`") == [
        "trainer/main.py:TrainerJob.run (no such symbol)", "weights/filesystem.py (no such file)",
        "run_dir.py (no such file)"]
    assert not stale_references("`trainer/main.py:TrainerJob.loop`, `tests/plan_reference.py`, `config/knobs.py`")
