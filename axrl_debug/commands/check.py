"""`axrl-debug check RUN --golden golden.json`: the CI gate. Compares a fresh run's per-step
metrics with a golden file and fails (exit 1) with a table of what moved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from axrl_debug.analysis.frames import step_table
from axrl_debug.analysis.gate import (GoldenError, check as run_check, junit_xml, machine_differences, parse_tol,
                                      read_golden)
from axrl_debug.commands.base import EXIT_FAILED, JSON_OPTION, BadInput, app, err, out, print_json, run_command
from axrl_debug.commands._common import fmt, open_run, report_problems, show, simple_table


def _environment_notes(golden: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """Differences in what the golden run and this run ran on (why values may legitimately move)."""
    src = golden.get("source") or {}
    notes = []
    torch_now = (manifest.get("versions") or {}).get("torch")
    if src.get("torch") and torch_now and src["torch"] != torch_now:
        notes.append(f"torch {torch_now} here, {src['torch']} in the golden run")
    if src.get("threads") and manifest.get("threads") and src["threads"] != manifest["threads"]:
        notes.append(f"{manifest['threads']} threads here, {src['threads']} in the golden run")
    return notes


def print_check(report: dict[str, Any], golden_path: Path, notes: list[str]) -> None:
    rows = []
    for m in report["per_metric"]:
        status = "[green]ok[/]" if not m["failed"] else f"[bold red]{m['failed']} moved[/]"
        rows.append([m["metric"], str(m["values"]), fmt(m["max_abs_diff"], 3), fmt(m["max_rel_diff"], 3),
                     f"{m['rtol']:g}", f"{m['atol']:g}", status])
    show(simple_table(f"check against {golden_path}", ["metric", "steps", "max |Δ|", "max rel",
                                                             "rtol", "atol", "status"], rows))
    if report["failures"]:
        frows = [[str(r["step"]), r["metric"], fmt(r["golden"], 10), fmt(r["actual"], 10), fmt(r["abs_diff"], 3),
                  fmt(r["rel_diff"], 3), fmt(r["atol"] + r["rtol"] * abs(float(r["golden"] or 0)), 3),
                  f"[bold red]{r['status']}[/]"] for r in report["failures"]]
        show(simple_table("what moved", ["step", "metric", "golden", "actual", "|Δ|", "rel", "allowed",
                                              "status"], frows))
    for n in notes:
        err.print(f"[yellow]note:[/] {n}; values are only reproducible bit for bit on the same setup")
    if report["passed"]:
        out.print(f"[bold green]PASS[/]: {report['checked']} values within tolerance")
    else:
        out.print(f"[bold red]FAIL[/]: {report['failed']} of {report['checked']} values moved")


def envelope_report(reader: Any) -> dict[str, Any]:
    """Every step's engine mismatch against the run's calibrated envelope (RUN/doctor/envelope.json)."""
    from axrl_debug.analysis.doctor import judge_steps
    from axrl_debug.analysis.envelope import load_or_calibrate

    env = load_or_calibrate(reader.path, reader.config, reader.manifest, reader.steps)
    _, rows = judge_steps(reader, reader.steps, env)
    outside = [r for r in rows.values() if not r["inside"]]
    return {"envelope": env.to_dict(), "steps": list(rows.values()), "outside": [r["step"] for r in outside],
            "passed": not outside}


def print_envelope(gate: dict[str, Any]) -> None:
    env = gate["envelope"]
    rows = [[str(r["step"]), fmt(r["mean_abs"], 3), fmt(r["max_abs"], 3), fmt(r["envelope_ratio"], 3),
             "[green]inside[/]" if r["inside"] else "[bold red]OUTSIDE[/]"] for r in gate["steps"]]
    show(simple_table(f"mismatch against the envelope ({env['source']}, {env['precision']}: mean |Δ| ≤ "
                      f"{fmt(env['mean_abs'], 3)}, max |Δ| ≤ {fmt(env['max_abs'], 3)})",
                      ["step", "mean |Δ|", "max |Δ|", "× bound", "verdict"], rows))
    if gate["passed"]:
        out.print("[bold green]PASS[/]: every step inside the envelope")
    else:
        out.print(f"[bold red]FAIL[/]: steps {gate['outside']} outside the envelope (run `axrl-debug doctor`)")


def envelope_gate(run: Path, json_out: bool) -> int:
    """`check RUN --envelope` without a golden file."""
    reader = open_run(run)
    gate = envelope_report(reader)
    gate.update({"run": str(reader.path), "problems": report_problems(reader)})
    if json_out:
        print_json(gate)
    else:
        print_envelope(gate)
    return 0 if gate["passed"] else EXIT_FAILED


@app.command()
def check(
    run: Path = typer.Argument(..., help="Fresh run directory to check."),
    golden: Path = typer.Option(None, "--golden", "-g", help="Golden JSON file (from `axrl-debug golden`)."),
    envelope: bool = typer.Option(False, "--envelope", help="Gate every step's engine mismatch on the run's "
                                  "calibrated envelope (`axrl-debug doctor`) instead of a single threshold; "
                                  "with --golden both gates apply."),
    rtol: float = typer.Option(None, "--rtol", min=0.0, help="Relative tolerance for every metric "
                               "(overrides the golden file's)."),
    atol: float = typer.Option(None, "--atol", min=0.0, help="Absolute tolerance for every metric."),
    tol: list[str] = typer.Option(None, "--tol", help="Per-metric tolerance METRIC=RTOL or METRIC=RTOL,ATOL "
                                  "(repeatable; wins over everything else), e.g. --tol loss=1e-6."),
    junit: Path = typer.Option(None, "--junit", help="Also write a JUnit XML report (one test case per step and metric)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Compare RUN's per-step metrics with a golden file: exit 0 when every value is within
    |actual − golden| ≤ atol + rtol·|golden|, 1 with a table of what moved otherwise, 2 on bad input.
    With --envelope, also 1 when a step's mismatch is outside the run's calibrated envelope."""

    def body() -> int:
        if golden is None and not envelope:
            raise BadInput("give --golden FILE, --envelope, or both")
        if golden is None:
            return envelope_gate(run, json_out)
        try:
            doc = read_golden(golden)
            overrides = parse_tol(tol or [])
        except (GoldenError, ValueError) as e:
            raise BadInput(str(e)) from None
        reader = open_run(run)
        df = step_table(reader)
        elsewhere = machine_differences(doc, reader.manifest)
        report = run_check(df, doc, rtol=rtol, atol=atol, overrides=overrides, same_machine=not elsewhere)
        if report["unknown_tol_metrics"]:
            raise BadInput(f"--tol names metric(s) not in the golden file: {report['unknown_tol_metrics']} "
                           f"(golden metrics: {doc['metrics']})")
        notes = _environment_notes(doc, reader.manifest)
        cross = doc.get("cross_machine_tolerances") or {}
        if elsewhere:
            notes.append(f"this run was made on another machine than the golden's ({'; '.join(elsewhere)})"
                         + (f": the golden's cross-machine tolerances apply to {', '.join(sorted(cross))}"
                            if cross else ": the golden file states no cross-machine tolerance"))
        report.update({"run": str(reader.path), "golden": str(golden), "notes": notes,
                       "machine": {"same": not elsewhere, "differences": elsewhere},
                       "problems": report_problems(reader)})
        if junit is not None:
            report["junit"] = str(junit_xml(report, junit))
        passed = report["passed"]
        if envelope:
            gate = envelope_report(reader)
            report["envelope_gate"] = gate
            passed = passed and gate["passed"]
        if json_out:
            report.pop("results")  # failures + per_metric say it all; keeps the document small
            print_json(report)
        else:
            print_check(report, golden, notes)
            if envelope:
                print_envelope(report["envelope_gate"])
        return 0 if passed else EXIT_FAILED

    run_command(body)
