"""The command line shows all of itself: ``peagle --help`` lists every command with a description, and
``peagle <command> --help`` works the same way for each (including those with parsers of their own, which one
table, ``peagle.cli.COMMANDS``, both lists and dispatches to)."""
from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from peagle import cli
from peagle.cli import build_parser, delegated, main

COMMANDS = ["draft", "models", "prepare", "regenerate", "extract", "train", "config", "run", "evaluate", "deploy",
            "pipeline", "serve", "replay", "refresh", "gate", "rollout"]


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0, argv
    return out.getvalue()


def test_top_level_help_lists_every_command_with_a_description():
    text = _help(["--help"])
    listed = dict(re.findall(r"^    (\w+)\s+(\S.*)$", text, flags=re.M))
    assert sorted(listed) == sorted(COMMANDS)
    assert all(len(desc) > 10 for desc in listed.values()), listed
    assert "Thin:" not in text and "python -m" not in text
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)  # nothing registered but hidden


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_under_its_own_name(command):
    text = _help([command, "--help"])
    assert text.startswith(f"usage: peagle {command}"), text[:80]


def test_one_table_lists_and_dispatches_the_commands_with_parsers_of_their_own():
    text = " ".join(_help(["--help"]).split())
    assert all(f"{name} {command.help}" in text for name, command in cli.COMMANDS.items())
    for command in cli.COMMANDS.values():
        for module in (command.module, *command.subcommands.values()):
            assert callable(importlib.import_module(module).main), module
    assert delegated(["rollout", "local", "--help"]) == ("peagle.commands.rollout_local", ["--help"])
    assert delegated(["rollout", "--name", "local"]) == ("peagle.rollout.cli", ["--name", "local"])
    assert delegated(["serve", "--port", "1"]) == ("peagle.commands.serve", ["--port", "1"])
    assert delegated(["prepare", "--out", "x"]) is None and delegated([]) is None


def test_a_dispatched_command_s_exit_status_comes_back(capsys):
    assert main(["replay", "--url", "http://127.0.0.1:9", "--prompts", "no-such-set"]) == 2
    assert capsys.readouterr().err.startswith("peagle: error:")
