"""Command help as a terminal should show it, for the `axrl` and `axrl-debug` Typer apps.

Docstrings are wrapped at ~100 columns in the source; Typer shows later paragraphs with those
line breaks kept, so help read "… when the step\\n is opened" at any terminal width. `Typer`
here joins every paragraph into one line (the terminal wraps it) and leaves blank lines between
paragraphs; a line that ends in a hyphen before a lowercase word joins without a space
("importance-" + "ratio"), as a compound word split by the wrap.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import typer


def reflow(doc: str) -> str:
    """``doc`` with each paragraph on one line, paragraphs separated by a blank line."""
    paragraphs = [p for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]
    return "\n\n".join(_join(p.split("\n")) for p in paragraphs)


def _join(lines: list[str]) -> str:
    out = lines[0].strip()
    for line in lines[1:]:
        line = line.strip()
        if not line:
            continue
        compound = out.endswith("-") and out[-2:-1].isalnum() and line[:1].islower()
        out += line if compound else " " + line
    return out


class Typer(typer.Typer):
    """typer.Typer whose commands' docstrings are reflowed (see the module docstring)."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        register = super().command(*args, **kwargs)

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if fn.__doc__:
                fn.__doc__ = reflow(fn.__doc__)
            return register(fn)

        return decorator
