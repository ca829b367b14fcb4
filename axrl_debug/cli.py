"""The `axrl-debug` command line: each command lives in `axrl_debug/commands/<name>.py` and
registers itself on the shared app (`axrl_debug/app.py`)."""

from __future__ import annotations

from axrl_debug.app import app

# Importing a command module registers its command(s). Keep one import per line.
# -- commands --
import axrl_debug.commands.summary  # noqa: F401
import axrl_debug.commands.mismatch  # noqa: F401
import axrl_debug.commands.spikes  # noqa: F401
import axrl_debug.commands.diff  # noqa: F401
import axrl_debug.commands.export  # noqa: F401
import axrl_debug.commands.golden  # noqa: F401
import axrl_debug.commands.check  # noqa: F401
import axrl_debug.commands.replay  # noqa: F401
import axrl_debug.commands.tui  # noqa: F401
# -- end commands --

if __name__ == "__main__":
    app()
