"""`axrl-debug tui RUN`: the terminal UI (steps → samples → tokens; docs/tui.md).

Interactive, so no ``--json``; bad input (missing run, unknown step) still exits 2 before the
screen is taken over. textual is imported only when the command runs, so ``axrl-debug --help``
and the other commands do not pay for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from axrl_debug.commands.base import BadInput, app, run_command
from axrl_debug.commands._common import describe_steps, nearest_steps


@app.command()
def tui(
    run: Path = typer.Argument(..., help="Run directory (holds manifest.json, metrics.jsonl, trace/)."),
    step: int = typer.Option(None, "--step", help="Open this step's samples directly."),
    sample: int = typer.Option(None, "--sample", help="With --step: open the tokens of the sample with this "
                               "sample id (the id column of the samples table, `mismatch` and `spikes`)."),
    no_scan: bool = typer.Option(False, "--no-scan",
                                 help="Do not read every step file in the background for max |Δ|, k3, "
                                      "routing agreement and version lag (the metrics.jsonl columns stay)."),
    against: str = typer.Option("trainer", "--against", help="Colour tokens by |trainer − rollout logprob| "
                                "('trainer') or, in an on-policy distillation run, |teacher − rollout| ('teacher'), "
                                "or, in a PPO run with a critic, by its value error |V − return| ('value')."),
) -> None:
    """Browse a run in the terminal: steps (sortable, spikes highlighted, sparklines), the samples
    of a step (sortable, filterable), and the tokens of a sample coloured by |trainer − rollout
    logprob| with per-token detail (ratio, entropy, advantage, policy version, MoE experts).

    Opens lazily: only metrics.jsonl is read to show the steps; a step file is read when the step
    is opened. Keys: ? for help, q to quit."""

    def body() -> int:
        from axrl_debug.tui.data import RunModel, RunOpenError

        if against not in ("trainer", "teacher", "value"):
            raise BadInput(f"--against {against!r}: expected 'trainer', 'teacher' or 'value'")
        try:
            model = RunModel(run, against=against)
        except RunOpenError as e:
            raise BadInput(str(e)) from None
        if against in _NEEDS and model.files:
            _require_column(model.files, step, against)
        if sample is not None and step is None:
            raise BadInput("--sample needs --step")
        if step is not None and step not in model.files:
            near = nearest_steps(sorted(model.files), step)
            raise BadInput(f"step {step} has no step file in {model.reader.trace_dir} (nearest: "
                           f"{', '.join(map(str, near)) or 'none'}; available: {describe_steps(sorted(model.files))})")
        if sample is not None:
            ids = _sample_ids(model.files[step])
            if sample not in ids:
                near = nearest_steps(sorted(ids), sample)
                raise BadInput(f"step {step} has no sample id {sample} (nearest: {', '.join(map(str, near))}; "
                               f"its sample ids: {describe_steps(sorted(ids))})")
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            # Without a terminal Textual would draw to nowhere and poll its input at full speed.
            raise BadInput("axrl-debug tui needs a terminal (stdin and stdout must be a TTY); in scripts use "
                           "`axrl-debug summary|mismatch|spikes RUN --json`, or run it inside tmux/screen")
        from axrl_debug.tui.app import DebugApp

        DebugApp(model, scan=not no_scan, step=step, sample=sample).run()
        return 0

    run_command(body)


_COLUMN_PROBES = 32  # step files opened at most to find one with per-token columns

# What each --against compares with, and the run that records it.
_NEEDS = {"teacher": ("teacher_logprob", "trained with on-policy distillation, config section `distill`"),
          "value": ("value", "trained with a critic, `algo.advantage: gae`")}


def _require_column(files: dict[int, Path], step: int | None, against: str) -> None:
    """Refuse --against teacher|value on a run whose step files lack the column it colours by:
    every token would show no Δ, which reads as "no difference". The step opened (else the
    first) is checked, or the next with per-token columns if it was recorded at trace.level
    summary; a run with none in its first steps is not refused (nothing to colour anyway)."""
    from axrl.runtime.recording.tiers import ATTR_TRACE_LEVEL
    from axrl.trace import StepFile, TraceError

    column, run_kind = _NEEDS[against]
    order = sorted(files, key=lambda s: (s != step, s))[:_COLUMN_PROBES]
    for s in order:
        try:
            with StepFile(files[s]) as sf:
                if sf.attrs.get(ATTR_TRACE_LEVEL) == "summary":
                    continue
                if f"/tokens/{column}" in sf:
                    return
        except (TraceError, OSError) as e:
            raise BadInput(f"{files[s]}: cannot read it ({e})") from None
        raise BadInput(f"--against {against}: {files[s].name} has no /tokens/{column} (the run was not {run_kind}); "
                       "open it without --against to colour by trainer − rollout logprob")


def _sample_ids(path: Path) -> set[int]:
    from axrl.trace import StepFile, TraceError

    try:
        with StepFile(path) as sf:
            return {int(i) for i in sf["/samples/sample_id"]}
    except (TraceError, OSError, KeyError) as e:
        raise BadInput(f"{path}: cannot read its sample ids ({e})") from None
