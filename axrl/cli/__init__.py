"""The `axrl` command line (`main.py`: train, serve, status, model …), the help formatting both
console scripts share (`help.py`) and `axrl model export` (`export.py`). Everything here reads a
config file and calls the assembly layer."""

from axrl.cli.main import app

__all__ = ["app"]
