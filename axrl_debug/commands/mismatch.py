"""`axrl-debug mismatch RUN [--step N | --steps A:B] [--top K] [--plot DIR]`: training–inference
mismatch metrics, breakdowns, routing agreement and the worst tokens (definitions in
``axrl_debug/analysis/mismatch/`` and docs/debugging.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import typer

from axrl.tokenizer import run_tokenizer
from axrl_debug.analysis.mismatch import MismatchConfig, attach_context, mismatch_report
from axrl_debug.analysis.mismatch.config import TEACHER_COLUMN
from axrl_debug.analysis.mismatch.top import collapse_identical
from axrl_debug.analysis.objective import objective_report
from axrl_debug.commands.base import JSON_OPTION, BadInput, app, err, out, print_json, run_command
from axrl_debug.commands._common import (STEP_OPTION_HELP, STEPS_OPTION_HELP, fmt, open_run, pct,
                                         report_problems, select_steps, show, simple_table, summary_note,
                                         summary_steps)

# (key, label, explanation) of the headline metrics, in display order
HEADLINE = (
    ("mean_abs", "mean |Δ|", "Δ = trainer old_logprob − rollout logprob"),
    ("p50_abs", "p50 |Δ|", ""),
    ("p99_abs", "p99 |Δ|", ""),
    ("max_abs", "max |Δ|", ""),
    ("mean", "mean Δ", "> 0: trainer more confident than the engine"),
    ("k1", "KL k1", "mean(−Δ) ≈ KL(rollout ‖ trainer), unbiased, can be < 0"),
    ("k2", "KL k2", "mean(Δ²/2), biased, ≥ 0"),
    ("k3", "KL k3", "mean(ρ−1−Δ) ≈ KL(rollout ‖ trainer), unbiased, ≥ 0"),
    ("chi2", "χ²", "mean((ρ−1)²) ≈ χ²(trainer ‖ rollout)"),
    ("token_mult_prob_error", "token_mult_prob_error", "mean exp|Δ|"),
    ("ratio_mean", "ratio ρ mean", "ρ = exp(Δ), the TIS weight before the cap"),
    ("ratio_std", "ratio ρ std", ""),
    ("ratio_min", "ratio ρ min", ""),
    ("ratio_max", "ratio ρ max", ""),
    ("frac_outside_clip", "outside clip band", "ρ ∉ [1−clip_low, 1+clip_high]"),
    ("frac_above_tis_cap", "above TIS cap", "ρ > tis_cap"),
    ("ess", "ESS (normalised)", "(Σρ)² / (n Σρ²)"),
    ("pearson_prob", "Pearson(p_rollout, p_train)", ""),
)
PERCENT_KEYS = {"frac_outside_clip", "frac_above_tis_cap"}
BREAKDOWN_TITLES = {"position": "by position in the response (per turn; 0 = first generated token)",
                    "turn": "by turn", "rollout_prob": "by rollout probability",
                    "entropy": "by trainer entropy (nats)", "version_lag": "by policy-version lag"}


BREAKDOWN_COLUMNS = ["tokens", "mean |Δ|", "mean Δ", "share of Σ|Δ|"]
SPLIT_PARTS = (("Δ", None, "old − rollout"),
               ("Δ_engine", "engine", "behaviour_train − rollout (same weights)"),
               ("Δ_staleness", "staleness", "old − behaviour_train (policy drift)"))


def _breakdown_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[str(r["bucket"]), str(r["count"]), fmt(r["mean_abs"], 3), fmt(r["mean"], 3), pct(r["abs_share"])]
            for r in rows if r["count"]]


def _signed(x: Any) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:+.3g}"


def _split_table(split: dict[str, Any]) -> Any:
    """Δ = Δ_engine + Δ_staleness over the tokens with a behaviour_train_logprob."""
    rows = []
    for label, key, meaning in SPLIT_PARTS:
        part = split if key is None else split[key]
        rows.append([label, fmt(part["mean_abs"], 7), fmt(part["mean"], 7),
                     pct(1.0 if key is None else part["abs_share"]), meaning])
    return simple_table(f"Δ = Δ_engine + Δ_staleness over {split['tokens']} split tokens "
                        f"(share of Σ|Δ| = Σ sign(Δ)·part / Σ|Δ|)",
                        ["part", "mean |·|", "mean", "share of Σ|Δ|", "meaning"], rows, justify_right=False)


def _split_lag_table(rows: list[dict[str, Any]]) -> Any:
    """The split per version-lag bucket (the ``delta_split`` of each ``version_lag`` row)."""
    cells = []
    for r in rows:
        x = r["delta_split"]
        if x["tokens"]:
            cells.append([str(r["bucket"]), str(x["tokens"]), fmt(x["engine"]["mean_abs"], 3),
                          fmt(x["staleness"]["mean_abs"], 3), pct(x["engine"]["abs_share"]),
                          pct(x["staleness"]["abs_share"])])
    return simple_table("Δ = Δ_engine + Δ_staleness by policy-version lag",
                        ["version_lag", "split tokens", "mean |Δ_engine|", "mean |Δ_stale|", "engine share",
                         "staleness share"], cells)


def _count_generated(reader: Any, res: dict[str, Any]) -> None:
    """Name the counts for what they are: the analysis's loss-mask count is `trained`, and
    `generated` counts the tokens the engine sampled (a rollout logprob or a policy version ≥ 0;
    a token can be generated and not trained, e.g. a masked turn or a dropped sample)."""
    tok = res["tokens"]
    tok["trained"] = tok.pop("generated")
    by_step = {}
    for sc in reader.iter_columns([], res["steps"], optional=("/tokens/rollout_logprob", "/tokens/policy_version")):
        gen = None
        if "/tokens/rollout_logprob" in sc:
            gen = ~np.isnan(np.asarray(sc["/tokens/rollout_logprob"], dtype=np.float32))
        if "/tokens/policy_version" in sc:
            ver = np.asarray(sc["/tokens/policy_version"]) >= 0
            gen = ver if gen is None else gen | ver
        by_step[sc.step] = 0 if gen is None else int(np.count_nonzero(gen))
    tok["generated"] = sum(by_step.values())
    for row in res.get("per_step") or []:
        row["trained"] = row.pop("generated", None)
        row["generated"] = by_step.get(row["step"], 0)


def print_report(res: dict[str, Any]) -> None:
    m, th, tok = res["metrics"], res["thresholds"], res["tokens"]
    steps = res["steps"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} steps ({steps[0]}–{steps[-1]})"
    if res.get("against") == "teacher":
        out.print("[bold]student–teacher (on-policy distillation):[/] below, Δ = teacher_logprob − rollout "
                  "logprob and 'trainer' reads 'teacher': KL k1 / k3 estimate KL(student ‖ teacher), the reverse "
                  "KL the distillation advantage minimises", highlight=False)
    out.print(f"[bold]{res['run']}[/] — {span}: {tok['analysed']} analysed tokens "
              f"(loss_mask = 1 with a rollout logprob) of {tok['trained']} trained (loss_mask = 1), "
              f"{tok['generated']} generated (sampled by the engine), {tok['total']} total; "
              f"clip band [{1 - th['clip_low']:g}, {1 + th['clip_high']:g}], TIS cap {th['tis_cap']:g}",
              highlight=False)
    # 7 digits: ratio / ESS / token_mult_prob_error sit next to 1 and would all print as "1"
    rows = [[label, pct(m[key]) if key in PERCENT_KEYS else fmt(m[key], 7), note] for key, label, note in HEADLINE]
    show(simple_table(None, ["metric", "value", "meaning"], rows, justify_right=False))
    if res.get("delta_split"):
        show(_split_table(res["delta_split"]))
    for name, brows in (res.get("breakdowns") or {}).items():
        show(simple_table(BREAKDOWN_TITLES.get(name, name), [name, *BREAKDOWN_COLUMNS], _breakdown_rows(brows)))
        if name == "version_lag" and res.get("delta_split"):
            show(_split_lag_table(brows))
    routing = res.get("routing")
    if routing:
        show(simple_table(
            f"routing agreement, rollout vs trainer expert sets: {pct(routing['agreement'])} of "
            f"{routing['rows']} valid rows × {len(routing['layers'])} layers",
            ["layer", "same expert set", "mean overlap"],
            [[str(r["layer"]), pct(r["agreement"]), pct(r["overlap"])] for r in routing["layers"]]))
        show(simple_table("|Δ| by routing of the predicting position (row t−1)",
                               ["routing", *BREAKDOWN_COLUMNS], _breakdown_rows(routing["delta"])))
    _print_objective(res.get("objective"))
    if res.get("top"):
        split = any("engine_delta" in t for t in res["top"])
        rows = []
        for i, t in enumerate(res["top"], 1):
            rows.append([str(i), str(t["step"]), _samples_cell(t), fmt(t.get("position")),
                         fmt(t.get("turn")), fmt(t.get("policy_version")), f"{t['delta']:+.3g}",
                         *([_signed(t.get("engine_delta")), _signed(t.get("staleness_delta"))] if split else []),
                         f"{t['rollout_prob']:.3g}", f"{t['trainer_prob']:.3g}", t.get("routing") or "–"])
        show(simple_table(f"top {len(res['top'])} tokens by |Δ|",
                          ["#", "step", "sample_id", "pos", "turn", "ver", "Δ", *(["Δ_eng", "Δ_stale"] if split else []),
                           "p_roll", "p_train", "routing"], rows))
        for i, t in enumerate(res["top"], 1):
            # context on its own line: it needs the width more than the numbers do
            out.print(f"  #{i:<2} {t.get('context') or ''}", highlight=False, markup=False, soft_wrap=True)


def _samples_cell(t: dict[str, Any]) -> str:
    """The sample id, and how many identical samples share the row (`collapse_identical`)."""
    n = t.get("identical", 1)
    return fmt(t["sample_id"]) + (f" (+{n - 1} identical)" if n > 1 else "")


def public_token(t: dict[str, Any]) -> dict[str, Any]:
    """A top token as commands show it: ``sample_id`` names its sample (what `tui --sample` takes),
    ``row`` is only its row in the step file's /samples (the analysis calls that ``sample``)."""
    out = {k: v for k, v in t.items() if k != "sample"}
    out["row"] = t["sample"]
    return out


def _print_objective(obj: dict[str, Any] | None) -> None:
    """What the objective and corrections did to the analysed steps' loss tokens (analysis/objective.py)."""
    if not obj or not obj["tokens"]:
        return
    w = obj["is_weight"]
    rows = [[r["rule"], str(r["tokens"]), pct(r["frac"]), r["meaning"]] for r in obj["rules"] if r["tokens"]]
    show(simple_table(f"objective and corrections over {obj['tokens']} loss tokens: hard-clipped "
                      f"{pct(obj['clipped_frac'])}, masked (weight 0) {pct(obj['masked_frac'])}, correction weight "
                      f"mean {fmt(w['mean'], 4)} [{fmt(w['min'], 3)}, {fmt(w['max'], 3)}]",
                      ["rule", "tokens", "share", "meaning"], rows or [["–", "0", "0.0%", "no rule acted"]],
                      justify_right=False))


def _check_against(reader: Any, steps: list[int] | None, against: str) -> None:
    """Refuse an unknown --against, or 'teacher' on a run whose first selected step has no
    /tokens/teacher_logprob (not trained with `distill`)."""
    if against not in ("trainer", "teacher"):
        raise BadInput(f"--against {against!r}: expected 'trainer' or 'teacher'")
    first = (steps or list(reader.steps) or [None])[0]
    if against == "teacher" and first is not None:
        with reader.open(first) as sf:
            if TEACHER_COLUMN not in sf:
                raise BadInput(f"--against teacher: step {first} has no {TEACHER_COLUMN} (the run was not "
                               "trained with on-policy distillation, config section `distill`)")


@app.command()
def mismatch(
    run: Path = typer.Argument(..., help="Run directory."),
    step: int = typer.Option(None, "--step", help=STEP_OPTION_HELP),
    steps: str = typer.Option(None, "--steps", help=STEPS_OPTION_HELP),
    top: int = typer.Option(10, "--top", min=0, help="Show the K tokens with the largest |Δ| (0: none)."),
    plot: Path = typer.Option(None, "--plot", help="Write PNG figures (distributions, breakdowns) to this directory."),
    workers: int = typer.Option(0, "--workers", min=0, help="Processes reading step files in parallel "
                                "(0 = auto: one per usable CPU, for runs over ~48 MB of step files per process)."),
    against: str = typer.Option("trainer", "--against", help="Compare the rollout logprob with the 'trainer' "
                                "(old_logprob) or, in an on-policy distillation run, the 'teacher' "
                                "(/tokens/teacher_logprob): the student–teacher KL by turn, position and token."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Training–inference mismatch over generated tokens (loss_mask = 1), Δ = trainer old_logprob −
    rollout logprob: |Δ| stats, KL estimators k1/k2/k3 of KL(rollout ‖ trainer), χ², importance-
    ratio stats, clip-band / TIS-cap fractions, ESS, Pearson correlation; breakdowns by position,
    turn, rollout probability, trainer entropy, policy-version lag and (MoE) routing agreement;
    what the objective and corrections did (share of loss tokens per rule, correction weights); the
    worst tokens with their decoded context. With /tokens/behaviour_train_logprob (asynchronous
    runs), Δ = Δ_engine + Δ_staleness: engine mismatch at the generating weights vs policy drift,
    overall, per version lag and per worst token. With --against teacher (a `distill` run), the same
    report of Δ = teacher − rollout logprob: the student–teacher reverse KL. Default: all steps."""

    def body() -> int:
        reader = open_run(run)
        chosen = select_steps(reader, step, steps)
        _check_against(reader, chosen, against)
        # more candidates than shown: identical rows (one completion repeated in a group) collapse
        cfg = MismatchConfig.from_run_config(reader.config, top_k=top * 4, against=against,
                                             plot_points=20000 if plot is not None else 0)
        res, acc = mismatch_report(reader, chosen, cfg, workers=workers, context=False)
        attach_context(reader, res["top"], tokenizer=run_tokenizer(reader.config))  # the run's own tokenizer
        res["top"] = collapse_identical(res.get("top") or [], top)
        if not res["steps"]:
            report_problems(reader)
            raise BadInput("every selected step file is damaged (see the warnings above)")
        if plot is not None:
            from axrl_debug.plots import mismatch_plots
            res["plots"] = [str(p) for p in mismatch_plots(acc, res, plot)]
        _count_generated(reader, res)
        res["objective"] = objective_report(reader, res["steps"])
        res["problems"] = report_problems(reader)
        res["top"] = [public_token(t) for t in res.get("top") or []]
        res["against"] = against
        res["summary_level_steps"] = summary_steps(reader, res["steps"])
        if json_out:
            print_json(res)
            return 0
        print_report(res)
        if res.get("plots"):
            err.print(f"wrote {len(res['plots'])} figures to {plot}")
        if res["summary_level_steps"]:
            err.print(f"[yellow]note:[/] {summary_note(res['summary_level_steps'])}")
        elif math.isnan(res["metrics"]["mean_abs"]):
            err.print("[yellow]note:[/] no analysed tokens (no loss-mask tokens with a rollout logprob)")
        return 0

    run_command(body)
