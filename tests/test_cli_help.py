"""`--help` of every command of `axrl` and `axrl-debug` reads as written: each docstring paragraph
on one line at a wide terminal (no hard wraps mid-sentence), arguments as RUN (not {run}), flags
without a type (not `--json <bool>`)."""

from __future__ import annotations

import re

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl.cli.help import reflow
from axrl_debug.cli import COMMANDS, register_commands
from axrl_debug.cli import app as debug_app

register_commands(["axrl-debug"])  # every command, not just the invoked one


def commands(app: typer.Typer) -> list[tuple[list[str], Any]]:
    """(argv prefix, click command) of every leaf command (typer may vendor its own click)."""
    out: list[tuple[list[str], Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        if hasattr(cmd, "commands"):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, [*path, name])
        else:
            out.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return out


ALL = [("axrl", p, c) for p, c in commands(axrl_app)] + [("axrl-debug", p, c) for p, c in commands(debug_app)]


def test_every_command_is_covered():
    names = {" ".join(p) for tool, p, _ in ALL if tool == "axrl-debug"}
    assert names == set(COMMANDS)
    assert {"train", "serve", "model init", "model export", "model info"} <= {" ".join(p) for t, p, _ in ALL if t == "axrl"}


@pytest.mark.parametrize("tool,path,cmd", ALL, ids=[f"{t} {' '.join(p)}" for t, p, _ in ALL])
def test_help_reads_as_written(tool, path, cmd):
    app = axrl_app if tool == "axrl" else debug_app
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "2000", "TERMINAL_WIDTH": "2000"})
    assert result.exit_code == 0, result.output
    text = result.output
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage and "}" not in usage, usage
    for arg in (p for p in cmd.params if p.param_type_name == "argument"):
        assert arg.name.upper() in usage, usage
    assert "<bool>" not in text
    lines = [" ".join(line.strip(" │").split()) for line in text.splitlines()]
    for paragraph in reflow(cmd.callback.__doc__ or "").split("\n\n"):
        flat = " ".join(paragraph.split())
        assert any(flat in line for line in lines), f"paragraph wrapped or missing: {flat[:80]}…\n{text}"


def test_reflow_joins_wrapped_lines_and_hyphenated_words():
    doc = """First line of a paragraph
    that goes on; importance-
    ratio stats.

    Second paragraph,
    also wrapped."""
    assert reflow(doc) == "First line of a paragraph that goes on; importance-ratio stats.\n\nSecond paragraph, also wrapped."
    assert re.fullmatch(r"a - b", reflow("a -\nb"))   # a free-standing dash keeps its space
