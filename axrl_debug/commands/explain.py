"""`axrl-debug explain RUN --step N [--sample S --token T | --top K]`: where the engine and the
trainer part ways on a token — per layer and component, with activation patching.

Exit codes: 0 explained, 2 bad input (the step, sample or token does not exist or is not a
generated token; the run cannot be rebuilt). See docs/axrl-debug.md and replay/explain.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from axrl_debug.commands.base import EXIT_OK, JSON_OPTION, BadInput, app, err, out, print_json, run_command


def _g(v: float | None, digits: int = 4) -> str:
    if v is None or v != v:
        return "—"
    return f"{v:.{digits}g}"


def _router_cell(rt: dict[str, Any] | None) -> str:
    if rt is None:
        return ""
    sets = f"{rt['trainer_experts']}" if not rt["flip"] else f"FLIP {rt['engine_experts']}≠{rt['trainer_experts']}"
    flips = len(rt["flipped_positions"])
    return (f"{sets} margin {rt['trainer_margin']:.2g}" + (f", {flips} flipped pos." if flips else "")
            + f"; R3 here → {rt['r3_layer_gap']:+.3g}")


def token_table(tok: dict[str, Any]) -> Table:
    """The per-component table of one explained token (also the TUI's explain view)."""
    table = Table(box=box.SIMPLE, pad_edge=False)
    for col, justify in (("component", "left"), ("rel |eng−trn|", "right"), ("max |eng−trn|", "right"),
                         ("remaining gap", "right"), ("share", "right"), ("router (MoE)", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "router (MoE)")
    for r in tok["rows"]:
        table.add_row(r["name"], _g(r["rel_diff"], 3), _g(r["max_abs_diff"], 3), f"{r['remaining_gap']:+.4g}",
                      f"{r['share']:+.1%}", _router_cell(r["router"]))
    return table


def token_summary(tok: dict[str, Any]) -> list[str]:
    """The lines around the table: what was compared, and the verdict."""
    lines = [f"sample {tok['sample_id']}, token {tok['token']} (turn {tok['turn']}, response position "
             f"{tok['position']}) {tok['text']!r}: rollout logprob {tok['rollout_logprob']:.6g}, trainer "
             f"{tok['old_logprob']:.6g}, Δ {tok['old_logprob'] - tok['rollout_logprob']:+.4g}",
             f"  engine path {tok['engine_logprob']:.6g} ({'= the rollout logprob' if tok['engine_reproduces_rollout'] else 'differs from the rollout logprob'}), "
             f"trainer path {tok['trainer_logprob']:.6g} ({'= old_logprob' if tok['trainer_reproduces_old'] else 'differs from old_logprob'}); "
             f"gap {tok['gap']:+.4g}",
             f"  the token's logit: engine {tok['token_logit'][0]:.6g}, trainer {tok['token_logit'][1]:.6g} "
             f"({(tok['token_logit'][0] - tok['token_logit'][1]) / tok['logit_ulp']:+.3g} ulp of the logits' dtype)"]
    verdict = [f"named: {tok['named']}"]
    if tok["removed_at"]:
        verdict.append(f"gap removed from {tok['removed_at']} on")
    lines.append("  " + "; ".join(verdict))
    lines.append("  routing: " + (tok["flip"] or f"no flip explains the gap; with R3 this token's gap would be "
                                                 f"{tok['r3_gap']:+.4g}"))
    return lines


@app.command("explain")
def explain_command(
    run: Path = typer.Argument(..., help="Run directory (holds config.yaml, trace/, checkpoints/)."),
    step: int = typer.Option(..., "--step", help="Step whose tokens to explain."),
    sample: int | None = typer.Option(None, "--sample", help="Sample id of the token (with --token)."),
    token: int | None = typer.Option(None, "--token", help="Token index in the sample's stream (a generated token)."),
    turn: int | None = typer.Option(None, "--turn", help="Instead of --token: the turn of the token (with --pos)."),
    pos: int | None = typer.Option(None, "--pos", help="Instead of --token: its position in the turn's response "
                                   "(the `pos` and `turn` columns of `axrl-debug mismatch`)."),
    top: int = typer.Option(0, "--top", help="Explain the K tokens with the largest |old − rollout| (default 5)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write one PNG per token to this directory."),
    json_: bool = JSON_OPTION,
) -> None:
    """Run the engine's and the trainer's computation of tokens with hooks and patch one into the other:
    which layer and component (attention, router / experts, norm, LM head) makes the logprobs differ."""

    def body() -> int:
        from replay import ReplayInputError
        from replay.explain import explain_step

        from replay.explain import token_index

        if (turn is None) != (pos is None):
            raise BadInput("--turn and --pos go together")
        if turn is not None and token is not None:
            raise BadInput("--token: not with --turn/--pos")
        index = token
        if turn is not None:
            if sample is None:
                raise BadInput("--turn/--pos need --sample")
            try:
                index = token_index(run, step, sample, turn, pos)
            except ReplayInputError as e:
                raise BadInput(str(e)) from None
        if (sample is None) != (index is None):
            raise BadInput("--sample and --token (or --turn and --pos) go together")
        if sample is not None and top:
            raise BadInput("--top: not with --sample/--token")
        if top < 0:
            raise BadInput(f"--top: must be >= 1, got {top}")
        say = None if json_ else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
        try:
            result = explain_step(run, step, tokens=None if sample is None else [(sample, index)], top=top or 5,
                                  progress=say)
        except ReplayInputError as e:
            raise BadInput(str(e)) from None
        doc = result.to_dict()
        if plot is not None:
            from axrl_debug.plots import explain_plot

            doc["plots"] = [str(explain_plot(t, plot, step)) for t in doc["tokens"]]
        if json_:
            print_json(doc)
            return EXIT_OK
        _print(doc)
        return EXIT_OK

    run_command(body)


def _print(doc: dict[str, Any]) -> None:
    f = doc["fidelity"]["engine_path_vs_rollout_logprob"]
    out.print(f"[bold]explain[/] {doc['run']}  step {doc['step']}: {len(doc['tokens'])} token(s); engine path "
              f"(prefill + KV-cache decode, teacher-forced) reproduces {f['bitwise_equal']} of {f['tokens']} recorded "
              f"rollout logprobs bit for bit (max |diff| {f['max_abs_diff']:.3g}{_cached(f)}); trainer path = the "
              "micro-batches as trained", highlight=False)
    for note in doc["notes"]:
        out.print(f"note: {note}", highlight=False)
    for tok in doc["tokens"]:
        out.print("")
        lines = token_summary(tok)
        for line in lines[:3]:
            out.print(line, highlight=False)
        out.print(token_table(tok))
        for line in lines[3:]:
            out.print(line, highlight=False)
    for p in doc.get("plots", []):
        out.print(f"wrote {p}", highlight=False)
    t = doc["timings"]
    out.print(f"explained in {t['total_seconds']:.2f} s (rebuilding the policy {t['rebuild_seconds']:.2f} s, engine "
              f"path {t['engine_seconds']:.2f} s, trainer path and patches {t['trainer_seconds']:.2f} s)",
              highlight=False)


def _cached(fidelity: dict[str, Any]) -> str:
    """The prompt tokens the engine path took from its mirror of the run's prefix cache, if any."""
    n = fidelity.get("cached_prompt_tokens", 0)
    return f"; {n} prompt tokens from the run's prefix cache, mirrored" if n else ""
