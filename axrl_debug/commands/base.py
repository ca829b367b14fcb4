"""The `axrl-debug` Typer app and the conventions every command follows.

Exit codes: 0 success, 1 a check failed or a replay diverged, 2 bad input.
Every non-interactive command takes `--json` and then prints exactly one JSON document on
stdout (human-readable output goes to stderr or is suppressed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, NoReturn

import typer
from rich.console import Console

from axrl.cli.help import Typer

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

app = Typer(help="Analyse, replay and gate AxRL training traces.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _group() -> None:
    """Analyse, replay and gate AxRL training traces."""
    # A callback keeps `axrl-debug CMD …` a command group even when only the invoked command's
    # module is imported (Typer would otherwise run a lone command without its name).


out = Console()               # human-readable results
err = Console(stderr=True)    # warnings, errors, progress

JSON_OPTION = typer.Option(False, "--json", help="Print one machine-readable JSON document on stdout.")


class BadInput(Exception):
    """User error (missing run, unknown step, bad option): reported, exit code 2."""


def bad_input(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(EXIT_BAD_INPUT)


def _json_safe(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    if hasattr(o, "item") and callable(o.item):  # numpy scalars
        return _json_safe(o.item())
    if isinstance(o, Path):
        return str(o)
    return o


def print_json(data: Any) -> None:
    """One JSON document on stdout; NaN/inf become null (strict JSON)."""
    print(json.dumps(_json_safe(data), indent=None))


def run_command(fn: Callable[[], int | None]) -> None:
    """Run a command body, mapping BadInput/FileNotFoundError to exit 2 and returning its code."""
    try:
        code = fn()
    except BadInput as e:
        bad_input(str(e))
    except FileNotFoundError as e:
        bad_input(str(e))
    raise typer.Exit(code or EXIT_OK)
