"""`axrl-debug spikes RUN`: steps whose loss, grad norm, mismatch or reward leave a rolling robust
(median/MAD) baseline, each attributed to the samples and tokens that carry its loss and its
importance weights (method in ``axrl_debug/analysis/spikes.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from axrl_debug.analysis.frames import step_table
from axrl_debug.analysis.param_grads import gradient_attribution
from axrl_debug.analysis.spikes import DEFAULT_SPIKE_METRICS, SpikeConfig, attribute, detect
from axrl_debug.commands.base import JSON_OPTION, BadInput, app, out, print_json, run_command
from axrl_debug.commands._common import (STEPS_OPTION_HELP, fmt, open_run, pct, report_problems,
                                         select_steps, show, simple_table)


_D = SpikeConfig()     # the defaults: the type owns them, the options read them
UNFLAGGABLE_NOTE = ("A fault present from step 0 is the baseline itself and never a spike: compare the run "
                    "with a healthy one (`axrl-debug check RUN --golden FILE`, `axrl-debug diff RUN HEALTHY`) "
                    "and look at `axrl-debug mismatch RUN` for an engine/trainer gap.")


def _print_attribution(a: dict[str, Any]) -> None:
    if "error" in a:
        out.print(f"  [yellow]{a['error']}[/]")
        return
    src = "exact, from the replay dump" if a["source"] == "replay" else "proxy −A·w·g (no replay dump)"
    out.print(f"  loss attribution: {src}", highlight=False)
    srows = [[str(s["sample_id"]), str(s["group_id"]), fmt(s["reward"]), str(s["num_turns"]),
              ",".join(map(str, s["policy_versions"])) or "–", fmt(s["loss_contribution"], 3),
              pct(s["loss_share"]), fmt(s["seq_log_weight"], 3), fmt(s["max_abs_delta"], 3)]
             for s in a["samples_by_loss"]]
    show(simple_table("  samples by |loss contribution|",
                           ["sample_id", "group", "reward", "turns", "versions", "contribution", "share",
                            "Σ log w", "max |Δ|"], srows))
    trows = [[str(t["sample_id"]), str(t["position"]), str(t["turn"]), str(t["policy_version"]),
              fmt(t["advantage"], 3), fmt(t["delta"], 3), fmt(t["loss_contribution"], 3), pct(t["loss_share"])]
             for t in a["tokens_by_loss"]]
    show(simple_table("  tokens by |loss contribution|",
                           ["sample_id", "pos", "turn", "version", "advantage", "Δ", "contribution", "share"], trows))
    wrows = [[str(t["sample_id"]), str(t["position"]), str(t["turn"]), str(t["policy_version"]),
              str(t["version_lag"]), fmt(t["delta"], 3)] for t in a["tokens_by_weight"]]
    show(simple_table("  tokens by |log importance weight| = |Δ|",
                           ["sample_id", "pos", "turn", "version", "lag", "Δ"], wrows))
    g = a.get("gradient")
    if g:
        for key, title in (("layers", "layers"), ("tensors", "parameter tensors")):
            grows = [[r[key[:-1] if key == "layers" else "tensor"], fmt(r["grad_norm"], 3), fmt(r["baseline"], 3),
                      "–" if r["ratio"] != r["ratio"] else f"{r['ratio']:.1f}×", pct(r["share"])] for r in g[key]]
            show(simple_table(f"  {title} by gradient norm (largest update; baseline: median of the "
                              f"{g['history_steps']} steps before)",
                              [key[:-1] if key == "layers" else "tensor", "‖∇‖", "baseline", "ratio", "share of ‖∇‖²"],
                              grows))


@app.command()
def spikes(
    run: Path = typer.Argument(..., help="Run directory."),
    steps: str = typer.Option(None, "--steps", help=STEPS_OPTION_HELP),
    metrics: str = typer.Option(",".join(DEFAULT_SPIKE_METRICS), "--metrics",
                                help="Comma-separated step-table columns to watch (see `summary --json`)."),
    window: int = typer.Option(_D.window, "--window", min=1, help="Trailing baseline window, in steps."),
    threshold: float = typer.Option(_D.threshold, "--threshold", min=0.0,
                                    help="Flag |x − median| > threshold · 1.4826 · MAD (robust z)."),
    min_history: int = typer.Option(_D.min_history, "--min-history", min=1,
                                    help="Finite values needed in the window before a step can be flagged."),
    rel_floor: float = typer.Option(_D.rel_floor, "--rel-floor", min=0.0,
                                    help="Scale floor as a fraction of |median| (a flat history is not infinitely tight)."),
    min_ratio: float = typer.Option(_D.min_ratio, "--min-ratio", min=1.0,
                                    help="Grad norm and mismatch metrics must also reach this multiple of the baseline."),
    top: int = typer.Option(5, "--top", min=1, help="Samples/tokens listed per spike."),
    two_sided: bool = typer.Option(False, "--two-sided", help="Also flag drops of grad norm and mismatch "
                                   "metrics (by default only rises; loss and reward are always two-sided)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Detect loss / grad-norm / mismatch / reward spikes against a rolling median/MAD baseline and
    attribute each spike step to the samples and tokens with the largest contribution to the loss
    (exact from RUN/replay/step_N.h5 when the replay tool dumped it, else the −A·w·g proxy) and to
    the importance weights, with their turns and policy versions.

    A spike must be unusual (robust z) and large in its own units: grad norm and mismatch at least
    --min-ratio × the baseline, mismatch above 4 ulps of the run's dtype (rounding), the loss off its
    baseline by at least 1 % of the step's mean |advantage|. The first --min-history steps have no
    baseline and are never flagged: a fault present from step 0 is the baseline itself (compare the
    run against a healthy one: `check --golden`, `diff`, and `mismatch` for the engine gap)."""

    def body() -> int:
        reader = open_run(run)
        chosen = select_steps(reader, None, steps)
        names = tuple(m.strip() for m in metrics.split(",") if m.strip())
        df = step_table(reader, chosen)
        unknown = [m for m in names if m not in df.columns]
        if unknown:
            raise BadInput(f"unknown metric(s) {unknown}; choose from {[c for c in df.columns if c != 'step']}")
        cfg = SpikeConfig.for_run(reader.config, metrics=names, window=window, threshold=threshold,
                                  min_history=min_history, rel_floor=rel_floor, two_sided=two_sided,
                                  min_ratio=min_ratio)
        _, found = detect(df, cfg)
        spike_steps = sorted({s["step"] for s in found})
        attributions = {s: attribute(reader, s, top=top) for s in spike_steps}
        for s in spike_steps:  # which layer's gradient carried it (per-tensor norms, when recorded)
            if "error" not in attributions[s]:
                attributions[s]["gradient"] = gradient_attribution(reader, s, window=window, top=top)
        problems = report_problems(reader)
        blind = [int(x) for x in df["step"].iloc[:max(1, min(cfg.min_history, cfg.window))]]
        if json_out:
            print_json({"run": str(reader.path), "config": cfg.__dict__, "steps": len(df),
                        "spikes": found, "attributions": [attributions[s] for s in spike_steps],
                        "unflaggable_steps": blind, "unflaggable_note": UNFLAGGABLE_NOTE, "problems": problems})
            return 0
        if not found:
            out.print(f"no spikes in {len(df)} steps ({', '.join(names)}: none with |robust z| > {threshold:g} "
                      f"that is also above its noise floor; window {window})", highlight=False)
        if blind:
            span = f"step {blind[0]}" if len(blind) == 1 else f"steps {blind[0]}–{blind[-1]}"
            out.print(f"{span}: no baseline yet (--min-history {cfg.min_history}), never flagged. {UNFLAGGABLE_NOTE}",
                      highlight=False)
        if not found:
            return 0
        show(simple_table(
            f"{len(found)} spike(s) in {len(df)} steps (window {window}, |z| > {threshold:g})",
            ["step", "metric", "value", "baseline", "robust z"],
            [[str(s["step"]), s["metric"], fmt(s["value"]), fmt(s["baseline"]), f"{s['z']:+.1f}"] for s in found]))
        for s in spike_steps:
            which = ", ".join(f"{x['metric']} {x['direction']}" for x in found if x["step"] == s)
            out.print(f"\n[bold]step {s}[/] ({which})", highlight=False)
            _print_attribution(attributions[s])
        return 0

    run_command(body)
