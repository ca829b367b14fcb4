"""The `axrl-debug` command line: each command lives in `axrl_debug/commands/<name>.py` and
registers itself on the shared app (`axrl_debug/commands/base.py`) when imported."""

from __future__ import annotations

import importlib
import sys

from axrl_debug.commands.base import app

# Command name → module. Keep one entry per line.
COMMANDS = {
    "summary": "summary",
    "mismatch": "mismatch",
    "spikes": "spikes",
    "diff": "diff",
    "export": "export",
    "golden": "golden",
    "check": "check",
    "doctor": "doctor",
    "replay": "replay",
    "explain": "explain",
    "bisect": "bisect",
    "tui": "tui",
    "import": "import_cmd",
}


def register_commands(argv: list[str]) -> None:
    """Import the invoked command's module only, or all of them (for --help, tests, scripts).

    The analysis commands pull in pandas (~0.3 s); importing just the invoked one keeps
    `axrl-debug tui RUN` under a second to its first screen from a cold start.
    """
    invoked = argv[1] if len(argv) > 1 and argv[1] in COMMANDS else None
    for name in [invoked] if invoked else COMMANDS:
        importlib.import_module(f"axrl_debug.commands.{COMMANDS[name]}")


register_commands(sys.argv)

if __name__ == "__main__":
    app()
