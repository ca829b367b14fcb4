"""`axrl-debug bisect RUN --step N [--sample S] [--engine embedded] [--json]`: the first layer and
operation (a probe point of `axrl.model.probe_points`) where the engine's and the trainer's
computations of a sample's tokens differ by more than that operation's numerics floor.

Exit codes: 0 bisected (with or without a divergence), 2 bad input (the step or sample does not
exist, the engine cannot be captured, the run cannot be rebuilt). See docs/axrl-debug.md,
docs/debugging.md and replay/bisect.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from axrl_debug.commands.base import EXIT_OK, JSON_OPTION, BadInput, app, err, out, print_json, run_command

ENGINES = ("embedded", "sglang", "vllm")


def _list(xs: list[int], limit: int = 12) -> str:
    if not xs:
        return "none"
    head = ", ".join(str(x) for x in xs[:limit])
    return head + (f" … ({len(xs)} in all)" if len(xs) > limit else "")


def walk_table(doc: dict[str, Any]) -> Table:
    """Every probe point in forward order: positions over the floor, largest relative difference,
    floor, their ratio (the first divergence marked)."""
    table = Table(box=box.SIMPLE, pad_edge=False)
    for col, justify in (("layer", "right"), ("op", "left"), ("rows", "right"), ("over floor", "right"),
                         ("max size", "right"), ("floor", "right"), ("size/floor", "right"), ("", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    first = doc["first_divergence"]
    for p in doc["points"]:
        mark = "← first divergence" if first and (p["layer"], p["op"]) == (first["layer"], first["op"]) else ""
        if p["op"] == "topk_ids":
            size, floor = f"{int(p['size'])} pos.", f"{int(p['floor'])} ties"
        else:
            size, floor = f"{p['size']:.3g}", f"{p['floor']:.3g}"
        ratio = "—" if p["op"] == "topk_ids" else f"{p['max_ratio']:.3g}"
        table.add_row(str(p["layer"]) if p["layer"] >= 0 else "model", p["op"], str(p["rows"]), str(len(p["over"])),
                      size, floor, ratio, mark)
    return table


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The verdict: the first divergence, its tokens, routing there and the full-vocabulary view."""
    first = doc["first_divergence"]
    lines = []
    if first is None:
        lines.append("no divergence: every probe point's difference is within its numerics floor")
    else:
        where = f"layer {first['layer']}" if first["layer"] >= 0 else "after the last layer"
        experts = f" (expert(s) {first['experts']})" if first.get("experts") else ""
        point = next(p for p in doc["points"] if (p["layer"], p["op"]) == (first["layer"], first["op"]))
        turns = f" in turn(s) {point['turns']}" if point.get("turns") else ""
        lines.append(f"first divergence: {where}, {first['op']}{experts} at {len(first['tokens'])} position(s) "
                     f"{_list(first['tokens'])}{turns}")
        lines.append(f"  size {first['size']:.3g} (largest relative L2 difference) vs floor {first['floor']:.3g}"
                     f" ({doc['how']['engine'].get(first['op'], 'captured')} on the engine side)")
    rt = doc["routing"]
    if rt is not None:
        lines.append(f"  routing in layer {rt['layer']}: expert sets differ at {_list(rt['ids_differ'] or [])}; "
                     f"slot order at {_list(rt['slot_order_differs'] or [])}; weights over their floor at "
                     f"{_list(rt['weights_over_floor'] or [])}")
    vocab = doc["vocab"]
    if vocab:
        agree = sum(v["argmax_agree"] for v in vocab)
        lines.append(f"full vocabulary at {len(vocab)} sampled position(s): max KL(engine‖trainer) "
                     f"{max(v['kl_engine_trainer'] for v in vocab):.3g}, max KL(trainer‖engine) "
                     f"{max(v['kl_trainer_engine'] for v in vocab):.3g}, max total variation "
                     f"{max(v['total_variation'] for v in vocab):.3g}, min top-{vocab[0]['top_k']} overlap "
                     f"{min(v['top_k_overlap'] for v in vocab):.2f}, argmax agrees at {agree}/{len(vocab)}, max "
                     f"|Δ sampled-token logprob| {max(abs(v['sampled_logprob_diff']) for v in vocab):.3g}")
    return lines


@app.command("bisect")
def bisect_command(
    run: Path = typer.Argument(..., help="Run directory (holds config.yaml, trace/, checkpoints/)."),
    step: int = typer.Option(..., "--step", help="Recorded step to bisect."),
    sample: int | None = typer.Option(None, "--sample", help="Sample id (default: the sample with the largest "
                                      "|old − rollout| logprob gap)."),
    engine: str = typer.Option("embedded", "--engine", help="Engine side to capture: embedded (the engine path as "
                               "it ran) or sglang (a server launched with its tensor dump on, one teacher-forced "
                               "prefill) or vllm (a server launched with AxRL's worker extension, one teacher-forced prefill)."),
    engine_python: str = typer.Option(None, "--engine-python", help="With --engine sglang|vllm: the "
                                      "engine environment's interpreter (default: $AXRL_SGLANG_PYTHON / "
                                      "$AXRL_VLLM_PYTHON)."),
    cpu_compat: bool = typer.Option(None, "--cpu-compat/--no-cpu-compat", help="With --engine sglang: launch it "
                                    "through cpu_compat.py (default: on a CPU-only machine)."),
    json_: bool = JSON_OPTION,
) -> None:
    """Capture the engine's and the trainer's forward of one sample at every probe point (per layer: input
    norm, attention, router, expert choice and weights, each expert's output, the MoE combine, the residual;
    then final norm, logits, log-softmax) and name the first one whose difference exceeds its numerics floor."""

    def body() -> int:
        from replay import ReplayInputError
        from replay.bisect import bisect_step

        if engine not in ENGINES:
            raise BadInput(f"--engine {engine}: one of {', '.join(ENGINES)}")
        if engine == "embedded" and engine_python:
            raise BadInput("--engine-python: only with --engine sglang|vllm")
        if engine != "sglang" and cpu_compat is not None:
            raise BadInput("--cpu-compat: only with --engine sglang")
        say = None if json_ else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
        try:
            result = bisect_step(run, step, sample=sample, engine=engine, server=_server(run, step, engine, engine_python,
                                                                                         cpu_compat), progress=say)
        except ReplayInputError as e:
            raise BadInput(str(e)) from None
        doc = result.to_json()
        if json_:
            print_json(doc)
            return EXIT_OK
        _print(doc)
        return EXIT_OK

    run_command(body)


def _server(run: Path, step: int, engine: str, python: str | None, cpu_compat: bool | None):
    """The launch options of bisect's SGLang / vLLM server (the interpreter from the flag or the
    environment); None for the embedded engine."""
    import os

    from axrl_debug.commands.rescore import _cpu_only
    from replay.server_rescore import PYTHON_ENV, ServerOptions

    if engine not in PYTHON_ENV:
        return None
    python = python or os.environ.get(PYTHON_ENV[engine], "") or None
    compat = engine == "sglang" and (_cpu_only() if cpu_compat is None else cpu_compat)
    return ServerOptions(python=python, cpu_compat=compat, log_dir=run / "replay" / f"step_{step:06d}_bisect_{engine}_logs")


def _print(doc: dict[str, Any]) -> None:
    f = doc["fidelity"].get("engine_path_vs_rollout_logprob")
    if f is not None:
        how = (f"teacher-forced prefill + KV-cache decode in the recorded batches; reproduces {f['bitwise_equal']} "
               f"of {f['tokens']} rollout logprobs bit for bit")
    else:
        capture = "its tensor dump" if doc["engine"] == "sglang" else "AxRL's worker extension"
        how = f"a dedicated server with {capture} on, the sample's tokens in one teacher-forced prefill"
    out.print(f"[bold]bisect[/] {doc['run']}  step {doc['step']}, sample {doc['sample']}: engine {doc['engine']} "
              f"({how}) vs the trainer's micro-batch as trained"
              f"{' (R3: routing replayed)' if doc['r3'] else ''}", highlight=False)
    for note in doc["notes"]:
        out.print(f"note: {note}", highlight=False)
    lines = summary_lines(doc)
    for line in lines:
        out.print(line, highlight=False)
    out.print(walk_table(doc))
    derived = {op: how for op, how in doc["how"]["engine"].items() if not how.startswith("captured")}
    out.print("engine-side points not captured as such: " + "; ".join(f"{op}: {how}" for op, how in derived.items()),
              highlight=False)
    trainer = {op: how for op, how in doc["how"]["trainer"].items() if op != "*" and not how.startswith("captured")}
    if trainer:  # Megatron's trainer side (axrl/train/megatron/probe_hooks.py)
        out.print("trainer-side points not captured as such: " + "; ".join(f"{op}: {how}" for op, how in trainer.items()),
                  highlight=False)
    out.print("size: the largest relative L2 difference ‖engine − trainer‖ / ‖trainer‖ over the positions; floor: "
              "the largest rounding noise of the two sides there, measured against float64 runs (SGLang: see the "
              "note) "
              "(docs/debugging.md, \"Bisect\")", highlight=False)
