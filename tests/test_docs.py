"""The front door and the guide: README.md stays one screen of start (<= 250 lines) and points into ``docs/``,
whose index lists every page; every config key and every ``hpcrl`` command and option the docs name exists (a
renamed key or a removed option fails here, not in a user's first run)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from hpcrl.cli import _parser
from hpcrl.config import RunConfig
from hpcrl.config.verl_keys import VERL_KEYS
from hpcrl.config.verl import entry_of

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

KEY = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`")
"""A backticked dotted name, with or without ``=value``."""
FILE_SUFFIXES = {"py", "log", "json", "jsonl", "yaml", "yml", "md", "h5", "sh", "txt", "safetensors", "out", "png",
                 "html", "ipynb", "lock", "tmp", "sbatch", "toml", "cfg", "bin", "pt", "parquet", "csv", "so", "delta"}
COMMAND = re.compile(r"(?:^|\s|\$ )hpcrl ([a-z][a-z-]*)((?: [^\n]*)?)")
"""``hpcrl COMMAND ...`` at the start of a piece of code (an inline span or a line of a code block)."""
DATA_COLUMNS = {"reward_model.ground_truth", "extra_info.index", "extra_info.tools_kwargs"}
"""Dotted names of data columns (nested parquet fields), not config keys."""


def code(text: str) -> list[str]:
    """The inline code spans and the lines of the fenced code blocks of a page."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [line for b in blocks for line in b.splitlines()] + re.findall(r"`([^`\n]+)`", rest)


def _fields(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def resolves(key: str) -> bool:
    """``key`` names a field of the run config (a key inside a dict field, such as ``reward.kwargs.method``, counts
    once the dict is reached), or a verl key hpcrl reads."""
    if key in DATA_COLUMNS or entry_of(key.lstrip("+"))[0] is not None:
        return True
    cls: typing.Any = RunConfig
    for part in key.split("."):
        if not (dataclasses.is_dataclass(cls) and part in _fields(cls)):
            return False
        cls = _fields(cls)[part]
        cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)
        if cls is dict or typing.get_origin(cls) is dict:
            return True
    return True


def named_keys(text: str) -> set[str]:
    sections = {f.name for f in dataclasses.fields(RunConfig)} | {k.split(".")[0] for k in VERL_KEYS}
    return {k for k in KEY.findall(text) if k.split(".")[0] in sections and k.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_key_the_docs_name_exists(page):
    missing = sorted(k for k in named_keys(page.read_text()) if not resolves(k))
    assert not missing, f"{page.name} names config keys that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_and_option_the_docs_name_exists(page):
    cmds, bad = commands(), []
    for name, rest in (m for piece in code(page.read_text()) for m in COMMAND.findall(piece)):
        if name not in cmds:
            bad.append(f"hpcrl {name}")
            continue
        known = {o for a in cmds[name]._actions for o in a.option_strings}
        bad += [f"hpcrl {name} {o}" for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest.split("#")[0])
                if o not in known]
    assert not bad, f"{page.name} names commands or options that do not exist: {sorted(set(bad))}"


def test_the_checks_find_a_wrong_key_and_a_wrong_option():
    assert resolves("rollout.n") and resolves("reward.kwargs.method") and resolves("actor_rollout_ref.rollout.n")
    assert not resolves("rollout.nn") and not resolves("trainer.no_such_key")
    assert named_keys("set `rollout.nn=3`, see `trainer.log` and `config.yaml`") == {"rollout.nn"}
    assert [m for piece in code("hpcrl is a tool; `hpcrl run configs/tiny.yaml --no-such`\n```\n$ hpcrl status R\n```\n")
            for m in COMMAND.findall(piece)] == [("status", " R"), ("run", " configs/tiny.yaml --no-such")]


def test_the_readme_is_one_screen_of_start_and_the_guide_has_an_index():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is the front door: details belong in docs/"
    index = (DOCS / "index.md").read_text()
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not list {page.name}"
    assert "docs/index.md" in readme
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", readme + index):
        target = (REPO / link) if link.startswith("docs/") or link in ("ARCHITECTURE.md",) else DOCS / link
        assert target.exists() or (REPO / link).exists(), f"a link to {link} that does not exist"


def test_the_config_reference_is_the_one_the_code_writes_now():
    from hpcrl.config.reference import render

    page = DOCS / "config-reference.md"
    assert page.read_text() == render(), ("docs/config-reference.md is older than the config's dataclasses: "
                                          "python -m hpcrl.config.reference > docs/config-reference.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_to_a_file_or_section_resolves(page):
    """A link's file exists relative to the page, and a ``#section`` in it is one of that file's headings."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif section and file.suffix == ".md" and section not in {anchor(h) for h in re.findall(
                r"^#{1,6} (.*)$", file.read_text(), flags=re.M)}:
            bad.append(f"{target}: no such section in {file.name}")
    assert not bad, f"{page.name} has links that lead nowhere: {bad}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
