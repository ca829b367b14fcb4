"""`axrl-debug doctor RUN [--step N] [--json] [--validate]`: the ranked causes of a run's mismatch,
each with its evidence, a confidence and the next command (axrl_debug/analysis/doctor/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from axrl_debug.commands._common import fmt, open_run, simple_table, show
from axrl_debug.commands.base import JSON_OPTION, BadInput, app, err, out, print_json, run_command


def print_report(report: dict[str, Any]) -> None:
    """The human-readable report: the envelope, the per-step table, the findings."""
    env = report["envelope"]
    out.print(f"envelope ({env['source']}, {env['precision']}): mean |Δ| ≤ {fmt(env['mean_abs'], 3)}, "
              f"max |Δ| ≤ {fmt(env['max_abs'], 3)} ({'measured' if env['source'] == 'rescore' else 'dtype'} floor "
              f"{fmt(env['floor_mean_abs'], 3)})")
    if env["source"] != "rescore" and not (env.get("calibration") or {}).get("precision_stated", True):
        out.print("   the run states no rollout precision, so fp32 is assumed: a bf16/fp16/fp8 engine's rounding "
                  "then reads as outside. State it in config.yaml (rollout.dtype), or for an imported run with "
                  "`axrl-debug import FORMAT SRC RUN --rollout-dtype bf16`")
    rows = [[str(r["step"]), str(r["policy_version"]), fmt(r["mean_abs"], 3), fmt(r["max_abs"], 3),
             fmt(r.get("envelope_ratio"), 3), "[green]inside[/]" if r["inside"] else "[bold red]OUTSIDE[/]"]
            for r in report["per_step"]]
    show(simple_table("mismatch against the envelope", ["step", "version", "mean |Δ|", "max |Δ|", "× bound",
                                                         "verdict"], rows))
    for i, f in enumerate(report["findings"], 1):
        proven = " [bold green]PROVEN[/]" if f["proven"] else ""
        out.print(f"[bold]{i}. {f['cause']}[/] (confidence {f['confidence']:.2f}){proven}: {f['summary']}")
        ev = {k: v for k, v in f["evidence"].items() if not isinstance(v, (list, dict)) or k in ("per_step", "layer_flip_rate")}
        if ev:
            out.print("   evidence: " + ", ".join(f"{k}={_short(v)}" for k, v in ev.items()))
        for h in (f.get("proof") or {}).get("hypotheses", []):
            out.print(f"   re-executed: {h['hypothesis']} → {h['verdict']}")
        for m in f.get("validation") or []:
            if not m.get("measured"):
                out.print(f"   mitigation {m['mitigation']}: not measured ({m['why']})")
                continue
            mark = "[green]recommended[/]" if m.get("recommended") else "not recommended"
            out.print(f"   mitigation {m['mitigation']}: gradient error {fmt(m['grad_rel_error'], 3)} (baseline "
                      f"{fmt(m['baseline_grad_rel_error'], 3)}), cosine {fmt(m['grad_cosine'], 5)} (baseline "
                      f"{fmt(m['baseline_grad_cosine'], 5)}), loss error {fmt(m['loss_error'], 3)} (baseline "
                      f"{fmt(m['baseline_loss_error'], 3)}) vs the on-policy reference: {mark}")
        out.print(f"   next: [cyan]{f['next_command']}[/]")


def _short(v: Any) -> str:
    return fmt(v, 3) if isinstance(v, float) else str(v)


@app.command()
def doctor(
    run: Path = typer.Argument(..., help="Run directory."),
    step: int = typer.Option(None, "--step", help="Diagnose step N only."),
    validate: bool = typer.Option(False, "--validate", help="Replay the flagged step under each fitting mitigation "
                                  "and report its measured effect on the loss and gradient."),
    no_reexec: bool = typer.Option(False, "--no-reexec", help="Trace-only: do not test hypotheses by re-running "
                                   "rollouts (and calibrate the envelope without re-scoring)."),
    recalibrate: bool = typer.Option(False, "--recalibrate", help="Recompute the cached envelope (RUN/doctor/envelope.json)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Name the cause of RUN's training–inference mismatch: ranked findings (cause, evidence, confidence,
    next command) against the run's calibrated envelope. Exit 0 when the top finding is
    within_envelope or precision, 1 otherwise, 2 on bad input."""
    from axrl_debug.analysis.doctor import diagnose

    def body() -> int:
        reader = open_run(run)
        if step is not None and step not in reader.steps:
            raise BadInput(f"step {step} is not in the trace of {run} (steps {reader.steps[0]}–{reader.steps[-1]})")
        say = (lambda msg: None) if json_out else (lambda msg: err.print(f"[dim]{msg}[/]"))
        report = diagnose(reader.path, step=step, rescore=not no_reexec, reexec=not no_reexec, validate=validate,
                          refresh=recalibrate, progress=say)
        if json_out:
            print_json(report)
        else:
            print_report(report)
        return 0 if report["top"] in ("within_envelope", "precision") else 1

    run_command(body)
