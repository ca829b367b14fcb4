"""`python -m axrl.cli …` is the `axrl` console script."""

from axrl.cli.main import app

app()
