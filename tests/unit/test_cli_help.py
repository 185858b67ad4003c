"""The command line shows all of itself: ``peagle --help`` lists every command with a description, and
``peagle <command> --help`` works the same way for each (including those with parsers of their own)."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from peagle.cli import build_parser, main

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
