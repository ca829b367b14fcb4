"""`axrl-debug diff RUN_A RUN_B [--rtol --atol]`: step-aligned comparison of two runs; reports the
first step where a metric diverges beyond tolerance (exit 1), plus the first step whose weights
fingerprints and whose sampled tokens differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer

from axrl.trace import TraceReader
from axrl_debug.analysis.diff import DEFAULT_DIFF_METRICS, diff_tables
from axrl_debug.analysis.frames import step_table
from axrl_debug.commands.base import EXIT_FAILED, JSON_OPTION, BadInput, app, out, print_json, run_command
from axrl_debug.commands._common import fmt, open_run, report_problems, show, simple_table


def tokens_equal(a: TraceReader, b: TraceReader, steps: list[int]) -> dict[int, bool]:
    """Per common step: are the sampled token streams (/tokens/ids and offsets) identical?"""
    cols = ["/samples/offsets", "/tokens/ids"]
    ca = {sc.step: sc for sc in a.iter_columns(cols, steps)}
    cb = {sc.step: sc for sc in b.iter_columns(cols, [s for s in steps if s in ca])}
    return {s: all(np.array_equal(ca[s][c], cb[s][c]) for c in cols) for s in cb}


@app.command()
def diff(
    run_a: Path = typer.Argument(..., help="Run under test (e.g. after a code change)."),
    run_b: Path = typer.Argument(..., help="Reference run (e.g. before the change)."),
    rtol: float = typer.Option(1e-5, "--rtol", min=0.0, help="Relative tolerance: |a−b| ≤ atol + rtol·|b|."),
    atol: float = typer.Option(1e-12, "--atol", min=0.0, help="Absolute tolerance."),
    metrics: str = typer.Option(",".join(DEFAULT_DIFF_METRICS), "--metrics",
                                help="Comma-separated step-table columns to compare."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Compare two runs step by step (aligned on step number) and report the first step where they
    diverge beyond tolerance. Exit 0 when every common step agrees, 1 when they diverge, 2 on bad
    input (no common step, missing run)."""

    def body() -> int:
        ra, rb = open_run(run_a), open_run(run_b)
        names = [m.strip() for m in metrics.split(",") if m.strip()]
        da, db = step_table(ra), step_table(rb)
        unknown = [m for m in names if m not in da.columns]
        if unknown:
            raise BadInput(f"unknown metric(s) {unknown}")
        common = sorted(set(da["step"]) & set(db["step"]))
        if not common:
            raise BadInput(f"the runs share no step ({run_a}: {len(da)} steps, {run_b}: {len(db)} steps)")
        res = diff_tables(da, db, names, rtol, atol, tokens_equal(ra, rb, common))
        res.update({"run_a": str(ra.path), "run_b": str(rb.path),
                    "problems": report_problems(ra) + report_problems(rb)})
        code = EXIT_FAILED if res["first_divergence"] is not None else 0
        if json_out:
            print_json(res)
            return code
        moved_rows = [[str(r["step"]), m["metric"], fmt(m["a"], 8), fmt(m["b"], 8), fmt(m["abs_diff"], 3),
                       fmt(m["rel_diff"], 3)] for r in res["steps"] for m in r["moved"]]
        if moved_rows:
            show(simple_table(f"values beyond tolerance (rtol {rtol:g}, atol {atol:g}); A = {run_a}, B = {run_b}",
                                   ["step", "metric", "A", "B", "|A−B|", "rel"], moved_rows[:60]))
            if len(moved_rows) > 60:
                out.print(f"… {len(moved_rows) - 60} more (use --json for all)")
        for label, key in (("metrics", "first_divergence"), ("weights fingerprints", "first_weights_divergence"),
                           ("sampled tokens", "first_token_divergence")):
            v = res[key]
            out.print(f"first step where {label} differ: {'none' if v is None else v}", highlight=False)
        if res["only_in_a"] or res["only_in_b"]:
            out.print(f"steps only in A: {res['only_in_a'] or '–'}; only in B: {res['only_in_b'] or '–'}",
                      highlight=False)
        verdict = ("[bold green]identical within tolerance[/]" if code == 0 else
                   f"[bold red]diverged at step {res['first_divergence']}[/] ({res['diverged_steps']} of "
                   f"{res['common_steps']} common steps differ)")
        out.print(f"{res['common_steps']} common steps: {verdict}")
        return code

    run_command(body)
