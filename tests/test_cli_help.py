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


def test_every_option_with_a_default_says_which():
    """``scale --wait-s``, ``doctor --shm-min-gib`` and ``--timeout-s`` showed none."""
    silent = []
    for name, (_, parser) in commands().items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            if action.default is not None and action.default != "" and "default" not in action.help.lower():
                silent.append(f"{name} {'/'.join(action.option_strings)} (default {action.default!r})")
    assert not silent, silent


def test_the_commands_users_rarely_type_are_marked_and_listed_last():
    listed = list(commands())
    internal = [name for name, (line, _) in commands().items() if line.startswith("internal (")]
    assert sorted(internal) == ["build-ops", "eval-job", "reward-job", "rollout", "sbatch-lines", "trainer"], internal
    assert listed[-len(internal):] == internal, listed


def test_the_help_answers_a_new_users_questions():
    run = commands()["run"][1].format_help()
    flat = " ".join(run.split())
    for said in ("default: slurm when srun is on PATH, else local", "docs/config-reference.md", "Ctrl-C",
                 "--resume", "Exit 0", "2: bad input", "130: stopped by Ctrl-C"):
        assert said in flat, said
    plan = " ".join(commands()["plan"][1].format_help().split())
    assert "pass --prompt-tokens" in plan and "a config without one is predicted with hpcrl's built-in numbers" in plan
    samples = " ".join(commands()["samples"][1].format_help().split())
    assert "trainer.keep_consumed_shards" in samples and "1: no trajectory" in samples
    engine = " ".join(commands()["eval"][1].format_help().split())
    assert "sets eval.engine: one of transformers, vllm, simulated" in engine
