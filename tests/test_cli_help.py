"""`hpcrl --help` and `hpcrl COMMAND --help`: every command says what it does and every option what it means."""
import argparse
import re

import pytest

from hpcrl.cli import _parser

DANGLING = {"a", "an", "and", "by", "for", "in", "not", "of", "or", "so", "that", "the", "to", "with"}
"""Words no help ends with unless it was cut mid-sentence (build-ops' said "so that a trainer's first start does not")."""


def commands() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Each command's name -> (its line in `hpcrl --help`, its parser)."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: (a.help, sub.choices[a.dest]) for a in sub._choices_actions}


def test_every_command_is_listed_with_help():
    listed = commands()
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(listed) == set(sub.choices) and len(listed) >= 15, sorted(sub.choices)


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_and_option_has_help_in_whole_sentences(name):
    line, parser = commands()[name]
    texts = {f"`hpcrl --help` line of {name}": line, f"`hpcrl {name} --help` description": parser.description}
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            texts[f"{name} {'/'.join(action.option_strings) or action.dest}"] = action.help
    for where, text in texts.items():
        assert text and text != argparse.SUPPRESS, f"{where} has no help"
        last = re.sub(r"[^\w]+$", "", text.strip()).split()[-1].lower()
        assert last not in DANGLING, f"{where} ends mid-sentence: {text!r}"
    shown = parser.format_help()
    for action in parser._actions:  # what `hpcrl NAME --help` prints names every option with its text
        for opt in action.option_strings:
            assert opt in shown, (name, opt)
