"""The `axrl-debug` command line (analysis commands arrive with the trace reader)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Analyse, replay and gate AxRL training traces.", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def main() -> None:
    """Analyse, replay and gate AxRL training traces."""


if __name__ == "__main__":
    app()
