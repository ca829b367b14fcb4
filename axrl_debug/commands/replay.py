"""`axrl-debug replay RUN --step N`: re-execute a recorded step bit for bit, dump it, run what-ifs.

Exit codes: 0 bitwise-equal, 1 diverged (first divergence reported), 2 bad input (the message
names the nearest usable step). See docs/replay.md.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.table import Table

from axrl_debug.commands.base import EXIT_FAILED, EXIT_OK, JSON_OPTION, BadInput, app, err, out, print_json, run_command

if TYPE_CHECKING:  # the replay library (and torch) load only when the command runs
    from replay import ReplayResult
    from replay.rollout import RolloutReplayResult, TeacherForcedResult


def _g(v: float | None, digits: int = 10) -> str:
    if v is None:
        return "—"
    return f"{v:.{digits}g}"


@app.command("replay")
def replay_command(
    run: Path = typer.Argument(..., help="Run directory (holds config.yaml, trace/, checkpoints/)."),
    step: int = typer.Option(..., "--step", help="Step to re-execute."),
    dump: bool = typer.Option(False, "--dump", help="Also write costly per-token / per-layer instrumentation "
                              "of the step to RUN/replay/step_N.h5."),
    set_: list[str] = typer.Option([], "--set", help="What-if: re-run the step with key=value changed "
                                   "(repeatable; all --set form one variant), e.g. --set algo.tis=false."),
    variant: list[str] = typer.Option([], "--variant", help="Another what-if variant as one string of "
                                      "assignments, e.g. --variant 'algo.loss=cispo' (repeatable)."),
    sweep: bool = typer.Option(False, "--sweep", help="Run a family of mitigation what-ifs (--family) and rank "
                               "them by how much each reduces the spike (largest update grad norm, update size)."),
    family: str = typer.Option("mitigations", "--family", help="Sweep family: mitigations, tis_cap, r3, advantage, "
                               "aggregation, objectives, corrections."),
    rollout: bool = typer.Option(False, "--rollout", help="Re-run the step's rollout instead (the policy of step N "
                                 "on the embedded engine, recorded prompts, seeds and batch composition) and "
                                 "compare token ids, rollout logprobs and routing bit for bit."),
    engine: str = typer.Option("", "--engine", help="With --rollout: 'embedded' re-runs the recorded token streams "
                               "through the embedded engine's decode path (teacher-forced) and compares its "
                               "logprobs with the recorded engine's and the trainer's (SGLang or free-running runs); "
                               "'sglang' / 'vllm' re-score them on that server (one prefill per stream) and report "
                               "its mismatch against the trainer beside the recorded engine's, on the same tokens."),
    url: str = typer.Option(None, "--url", help="With --engine sglang|vllm: a running server, which must serve the "
                            "step's policy as exported to RUN/replay/step_N_policy (the error says how to start it)."),
    engine_python: str = typer.Option(None, "--engine-python", help="With --engine sglang|vllm and no --url: the "
                                      "engine environment's interpreter to launch the server with (default: "
                                      "$AXRL_SGLANG_PYTHON / $AXRL_VLLM_PYTHON)."),
    cpu_compat: bool = typer.Option(None, "--cpu-compat/--no-cpu-compat", help="Launch SGLang through cpu_compat.py "
                                    "(default: on a CPU-only machine)."),
    server_args: list[str] = typer.Option([], "--server-args", help="Extra flags for the launched server (one "
                                          "string, split like a shell; repeatable)."),
    load_weights: bool = typer.Option(False, "--load-weights", help="With --engine sglang --url: load the step's "
                                      "policy into that server (/update_weights_from_disk) instead of requiring it "
                                      "be started on it (same architecture)."),
    json_: bool = JSON_OPTION,
) -> None:
    """Re-execute step N from the newest checkpoint at or before it and compare bit for bit."""

    def body() -> int:
        from replay import ReplayInputError, replay_step

        if engine and not rollout:
            raise BadInput("--engine: only with --rollout")
        if engine not in ("", "embedded", "sglang", "vllm"):
            raise BadInput(f"--engine: one of embedded, sglang, vllm, got {engine!r}")
        if engine in ("", "embedded") and (url or engine_python or server_args or load_weights
                                                  or cpu_compat is not None):
            raise BadInput("--url, --engine-python, --cpu-compat, --server-args and --load-weights: only with "
                           "--engine sglang|vllm")
        if rollout:
            if dump or set_ or variant or sweep:
                raise BadInput("--rollout: --dump, --set, --variant and --sweep act on the training part of a step")
            if engine in ("sglang", "vllm"):
                from axrl_debug.commands.rescore import run_rescore

                return run_rescore(run, step, engine, url, engine_python, cpu_compat, server_args, load_weights,
                                   json_)
            return _rollout(run, step, engine == "embedded", json_)

        variants = ([list(set_)] if set_ else []) + [shlex.split(v) for v in variant]
        if any(not v for v in variants):
            raise BadInput("--variant: empty variant")
        say = None if json_ else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
        try:
            result = replay_step(run, step, dump=dump, variants=variants, sweep=family if sweep else None,
                                 progress=say)
        except ReplayInputError as e:
            raise BadInput(str(e)) from None
        if json_:
            print_json(result.to_dict())
        else:
            _print(result)
        return EXIT_OK if result.verdict == "bitwise-equal" else EXIT_FAILED

    run_command(body)


def _rollout(run: Path, step: int, teacher_forced: bool, json_: bool) -> int:
    from replay import ReplayInputError
    from replay.rollout import replay_rollout, teacher_forced_check

    say = None if json_ else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
    try:
        result = teacher_forced_check(run, step, progress=say) if teacher_forced else replay_rollout(run, step,
                                                                                                     progress=say)
    except ReplayInputError as e:
        raise BadInput(str(e)) from None
    if json_:
        print_json(result.to_dict())
    elif teacher_forced:
        _print_teacher_forced(result)
    else:
        _print_rollout(result)
    if teacher_forced:
        return EXIT_OK if not result.train_mismatches else EXIT_FAILED
    return EXIT_OK if result.verdict == "bitwise-equal" else EXIT_FAILED


def _print_rollout(result: "RolloutReplayResult") -> None:
    steps = [s.step for s in result.steps]
    out.print(f"[bold]rollout replay[/] {result.run}  step {result.step} ({result.mode}): policy from checkpoint "
              f"step_{result.checkpoint_step:06d}, rollout re-run for step(s) {steps[0]}..{steps[-1]}", highlight=False)
    for note in result.notes:
        out.print(f"  note: {note}", highlight=False)
    table = Table(box=box.SIMPLE)
    for col in ("step", "samples", "tokens", "differing samples", ""):
        table.add_column(col, justify="right", no_wrap=True)
    for s in result.steps:
        table.add_row(str(s.step), str(s.samples), str(s.tokens), str(len(s.differing_samples)),
                      _eq(s.first is None))
    out.print(table)
    if result.train_mismatches:
        out.print(f"[red]training re-execution diverged[/] on the way: {result.train_mismatches[0].describe()}",
                  highlight=False)
    first = result.first_divergence
    if first is None and not result.train_mismatches:
        out.print(f"[bold green]bitwise-equal[/]: every sample's token ids, rollout logprobs, policy versions and "
                  f"routing match the trace; re-run in {result.seconds:.2f} s", highlight=False)
    elif first is not None:
        out.print(f"[bold red]DIVERGED[/] at {first.describe()}", highlight=False)


def _print_teacher_forced(result: "TeacherForcedResult") -> None:
    s, f = result.summary, result.fidelity
    out.print(f"[bold]teacher-forced rollout check[/] {result.run}  step {result.step}: {result.tokens} generated "
              f"tokens of the {result.engine} rollout re-run through the embedded engine's decode path", highlight=False)
    table = Table(box=box.SIMPLE)
    for col in ("difference", "mean |·|", "max |·|"):
        table.add_column(col, justify="left" if col == "difference" else "right", no_wrap=True)
    for label, key in (("embedded decode − recorded engine", "embedded_vs_recorded"),
                       ("trainer − embedded decode", "trainer_vs_embedded"),
                       ("trainer − recorded engine", "trainer_vs_recorded")):
        table.add_row(label, _g(s[f"mean_abs_{key}"], 4), _g(s[f"max_abs_{key}"], 4))
    out.print(table)
    out.print(f"embedded decode path reproduces {f['bitwise_equal']} of {f['tokens']} recorded logprobs bit for bit"
              + _cached_note(f), highlight=False)
    worst = Table(title="worst tokens by |trainer − recorded|", title_justify="left", box=box.SIMPLE)
    for col in ("sample_id", "token", "turn", "recorded", "embedded", "trainer"):
        worst.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        worst.add_row(str(r["sample_id"]), str(r["token"]), str(r["turn"]), _g(r["recorded"], 6),
                      _g(r["embedded"], 6), _g(r["trainer"], 6))
    out.print(worst)
    out.print(f"whose mismatch: {result.verdict}", highlight=False)


def _print(result: "ReplayResult") -> None:
    before = [s.step for s in result.steps[:-1]]
    out.print(f"[bold]replay[/] {result.run}  step {result.step} from checkpoint step_{result.checkpoint_step:06d}"
              + (f", re-ran step(s) {', '.join(map(str, before))} first" if before else ""), highlight=False)
    env = result.environment
    if result.warnings:  # already printed on stderr as they were found
        out.print(f"[yellow]{len(result.warnings)} environment warning(s)[/]: bitwise equality needs the "
                  "recording's environment", highlight=False)
    else:
        out.print(f"environment matches the recording: torch {env['versions']['torch']}, {env['threads']} "
                  f"thread(s), {env['backend']} backend on {env['device']}, host {env['host']}", highlight=False)
    for s in result.steps[:-1]:
        out.print(f"step {s.step} (rebuilding the state): " + ("bitwise-equal" if s.bitwise_equal
                                                              else f"{len(s.mismatches)} quantities differ"))
    table = Table(title=f"step {result.step}: recorded vs replayed", title_justify="left", box=box.SIMPLE)
    for col in ("update", "quantity", "recorded", "replayed", ""):
        table.add_column(col, justify="left" if col in ("quantity", "") else "right", no_wrap=True)
    target = result.target.to_dict()
    for u in target["updates"]:
        for mb in u["micro_batches"]:
            table.add_row(str(u["update"]), f"mb {mb['micro_batch']} loss ({mb['num_tokens']} tokens)",
                          _g(mb["loss"]["recorded"]), _g(mb["loss"]["replayed"]), _eq(mb["loss"]["equal"]))
        for q in ("loss", "grad_norm", "lr"):
            table.add_row(str(u["update"]), q, _g(u[q]["recorded"]), _g(u[q]["replayed"]), _eq(u[q]["equal"]))
    fp = target["fingerprint_after"]
    table.add_row("", "weights fingerprint", f"{str(fp['recorded'])[:12]}…", f"{str(fp['replayed'])[:12]}…",
                  _eq(fp["equal"]))
    critic = target.get("critic")
    if critic:  # PPO's critic, re-run after the policy (algo.advantage: gae)
        vl, cfp = critic["value_loss"], critic["fingerprint_after"]
        short = lambda v: " ".join(f"{float(x):.6g}" for x in str(v).split()) if v else "–"  # noqa: E731
        table.add_row("", "critic value loss", short(vl["recorded"]), short(vl["replayed"]), _eq(vl["equal"]))
        table.add_row("", "critic fingerprint", f"{str(cfp['recorded'])[:12]}…", f"{str(cfp['replayed'])[:12]}…",
                      _eq(cfp["equal"]))
    out.print(table)
    t = result.timings
    timing = f"step re-executed in {t['step_seconds']:.3f} s"
    if result.dump_path is not None:
        timing += " with --dump instrumentation"
    elif t.get("recorded_step_seconds"):
        timing += (f" (recorded {t['recorded_step_seconds']:.3f} s, "
                   f"ratio {t['step_seconds'] / t['recorded_step_seconds']:.2f}×)")
    first = result.first_divergence
    if first is None:
        out.print(f"[bold green]bitwise-equal[/]: every micro-batch loss, update loss, grad norm and weights "
                  f"fingerprint matches; {timing}", highlight=False)
    else:
        out.print(f"[bold red]DIVERGED[/] at {first.describe()}", highlight=False)
        out.print(f"  {len(result.mismatches)} recorded quantities differ in total; {timing}", highlight=False)
    if result.dump_path is not None:
        out.print(f"dump: {result.dump_path}", highlight=False)
    if result.sweep is not None:
        _print_ranking(result)
    elif result.variants:
        _print_variants(result)


def _eq(equal: bool) -> str:
    return "[green]=[/]" if equal else "[red]≠[/]"


def _print_variants(result: "ReplayResult") -> None:
    from replay import SUMMARY_KEYS

    out.print(f"what-if at step {result.step}, each from the same starting state:")
    names = [f"v{i + 1}" for i in range(len(result.variants))]
    for name, v in zip(names, result.variants):
        out.print(f"  {name}: {v.label}", highlight=False)
        for note in v.notes:
            out.print(f"      ({note})", highlight=False)
    table = Table(box=box.SIMPLE)
    table.add_column("metric", no_wrap=True)
    table.add_column("update", justify="right")
    table.add_column("baseline", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    n = max([len(result.baseline)] + [len(v.updates) for v in result.variants])
    rows = [result.baseline[u] if u < len(result.baseline) else {} for u in range(n)]
    for key in SUMMARY_KEYS:
        for u in range(n):
            if key not in rows[u] and not any(u < len(v.updates) and key in v.updates[u] for v in result.variants):
                continue
            cells = [_g(v.updates[u].get(key), 6) if u < len(v.updates) else "—" for v in result.variants]
            table.add_row(key, str(u), _g(rows[u].get(key), 6), *cells)
    out.print(table)


def _pct(change: float) -> str:
    if change != change:
        return "—"
    return "0.0%" if abs(change) < 5e-4 else f"{change * 100:+.1f}%"


def _print_ranking(result: "ReplayResult") -> None:
    base = result.baseline
    g0 = max((r["grad_norm"] for r in base if "grad_norm" in r), default=float("nan"))
    u0 = max((r["update_norm"] for r in base if "update_norm" in r), default=float("nan"))
    out.print(f"sweep '{result.sweep}' at step {result.step}: {len(result.ranking)} what-if(s) from the same "
              f"starting state, ranked by their largest update grad norm (Δ: change from the baseline's "
              f"{_g(g0, 6)}; update ‖Δθ‖ from {_g(u0, 6)})", highlight=False)
    table = Table(box=box.SIMPLE)
    for col in ("rank", "grad norm", "Δ", "update ‖Δθ‖", "Δ ", "loss"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("what-if", justify="left", overflow="fold", min_width=20)  # last: wraps, never cut
    for r in result.ranking:
        table.add_row(str(r.rank), _g(r.grad_norm, 5), _pct(r.grad_norm_change), _g(r.update_norm, 4),
                      _pct(r.update_norm_change), _g(r.loss, 4), r.label)
    out.print(table)
    notes = [(v.label, n) for v in result.variants for n in v.notes]
    for label, note in notes:
        out.print(f"  ({label}: {note})", highlight=False)


def _cached_note(fidelity: dict[str, Any]) -> str:
    """The prompt tokens the decode path took from its mirror of the run's prefix cache, if any."""
    n = fidelity.get("cached_prompt_tokens", 0)
    return f" ({n} prompt tokens taken from the run's prefix cache, mirrored)" if n else ""
