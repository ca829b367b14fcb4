"""Running the command-line tools in tests: `axrl train CONFIG --run-dir RUN --set K=V ...` and
`axrl-debug ...` in-process through typer's CliRunner, or as a subprocess's command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

from click.testing import Result
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl_debug.cli import app as debug_app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
#: the quickstart cut to two short steps, each with a checkpoint: a recorded step to replay or
#: re-score on another engine
SHORT_RUN = ("steps=2", "warmup.steps=20", "eval.every=0", "data.prompts_per_step=4", "rollout.group_size=4",
             "checkpoint.every=1", "runtime.threads=1")


def set_args(settings: Iterable[str]) -> list[str]:
    """`--set K=V` for each setting, in their order (a later one overrides an earlier one)."""
    return [a for s in settings for a in ("--set", str(s))]


def train_args(run: Path | str, settings: Iterable[str] = (), *extra: object,
               config: Path | str = QUICKSTART) -> list[str]:
    """The arguments after `axrl`: train `config` into `run` with `settings` and the `extra`
    arguments (e.g. "--resume")."""
    return ["train", str(config), "--run-dir", str(run), *map(str, extra), *set_args(settings)]


def axrl(*args: object) -> Result:
    """`axrl ARGS...` in-process; each argument goes through str() (paths, numbers)."""
    return CliRunner().invoke(axrl_app, [str(a) for a in args])


def debug(*args: object) -> Result:
    """`axrl-debug ARGS...` in-process; each argument goes through str() (paths, numbers)."""
    return CliRunner().invoke(debug_app, [str(a) for a in args])


def train(run: Path | str, settings: Iterable[str] = (), *extra: object, config: Path | str = QUICKSTART,
          check: bool = True) -> Result:
    """`axrl train` in-process (see train_args). With `check`, a non-zero exit fails the test with
    the command's output; without, the caller asserts on the result (e.g. a refusal's exit code 2)."""
    result = axrl(*train_args(run, settings, *extra, config=config))
    if check:
        assert result.exit_code == 0, result.output
    return result


def train_command(run: Path | str, settings: Iterable[str] = (), *extra: object,
                  config: Path | str = QUICKSTART) -> list[str]:
    """`python -m axrl.cli train ...` (see train_args) for subprocess.run/Popen: a run a test kills,
    or runs beside another."""
    return [sys.executable, "-m", "axrl.cli", *train_args(run, settings, *extra, config=config)]
