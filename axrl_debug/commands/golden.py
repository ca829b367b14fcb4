"""`axrl-debug golden RUN -o golden.json`: freeze a run's per-step metrics as the reference of the
CI gate (`axrl-debug check`). Format and tolerance rules: ``axrl_debug/analysis/gate.py``."""

from __future__ import annotations

from pathlib import Path

import typer

from axrl_debug.analysis.frames import step_table
from axrl_debug.analysis.gate import (DEFAULT_ATOL, DEFAULT_GOLDEN_METRICS, DEFAULT_RTOL, make_golden,
                                      parse_tol, write_golden)
from axrl_debug.commands.base import JSON_OPTION, BadInput, app, err, out, print_json, run_command
from axrl_debug.commands._common import STEPS_OPTION_HELP, open_run, report_problems, select_steps

TOL_HELP = "Per-metric tolerance stored in the golden file: METRIC=RTOL or METRIC=RTOL,ATOL (repeatable)."


@app.command()
def golden(
    run: Path = typer.Argument(..., help="Run directory to freeze (a short deterministic run)."),
    output: Path = typer.Option(..., "-o", "--output", help="Golden JSON file to write."),
    steps: str = typer.Option(None, "--steps", help=STEPS_OPTION_HELP),
    metrics: str = typer.Option(",".join(DEFAULT_GOLDEN_METRICS), "--metrics",
                                help="Comma-separated step-table columns to freeze."),
    rtol: float = typer.Option(DEFAULT_RTOL, "--rtol", min=0.0, help="Default relative tolerance stored in the file."),
    atol: float = typer.Option(DEFAULT_ATOL, "--atol", min=0.0, help="Default absolute tolerance stored in the file."),
    tol: list[str] = typer.Option(None, "--tol", help=TOL_HELP),
    cross_tol: list[str] = typer.Option(None, "--cross-machine-tol", help="Tolerance for a run checked on "
                                        "another machine than this run's (other CPU flags, platform or torch "
                                        "build): METRIC=RTOL or METRIC=RTOL,ATOL, stored in the file (repeatable)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Write the per-step metrics of RUN (loss, grad norm, reward, mismatch, routing agreement, …)
    and the run's provenance (git sha, torch version, threads) to a golden JSON file."""

    def body() -> int:
        reader = open_run(run)
        chosen = select_steps(reader, None, steps)
        names = [m.strip() for m in metrics.split(",") if m.strip()]
        try:
            tolerances = parse_tol(tol or [])
            cross = parse_tol(cross_tol or [])
        except ValueError as e:
            raise BadInput(str(e)) from None
        df = step_table(reader, chosen)
        unknown = [m for m in names if m not in df.columns]
        if unknown:
            raise BadInput(f"unknown metric(s) {unknown}; choose from {[c for c in df.columns if c != 'step']}")
        doc = make_golden(df, run=str(reader.path), manifest=reader.manifest, metrics=names, rtol=rtol,
                          atol=atol, tolerances=tolerances, cross_machine=cross)
        path = write_golden(doc, output)
        problems = report_problems(reader)
        if json_out:
            print_json({"golden": str(path), "steps": len(doc["steps"]), "metrics": doc["metrics"],
                        "problems": problems})
        else:
            out.print(f"wrote {path}: {len(doc['steps'])} steps × {len(doc['metrics'])} metrics "
                      f"({', '.join(doc['metrics'])})", highlight=False)
            if problems:
                err.print("[yellow]note:[/] damaged steps were left out of the golden file")
        return 0

    run_command(body)
