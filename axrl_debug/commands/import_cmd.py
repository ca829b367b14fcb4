"""`axrl-debug import FORMAT SRC RUN`: write an AxRL run from another framework's dumps (slime,
miles, NeMo-RL, AxisRL), so every analysis reads it. See docs/import.md."""

from __future__ import annotations

from pathlib import Path

import typer

from axrl_debug.commands.base import JSON_OPTION, BadInput, app, out, print_json, run_command


@app.command("import")
def import_command(
    format: str = typer.Argument(..., help="slime, miles, nemo-rl or axisrl."),  # noqa: A002 - the usage line's name
    src: Path = typer.Argument(..., help="The dumps: a directory (searched recursively) or one file."),
    run: Path = typer.Argument(..., help="Run directory to write (must not exist or be empty, unless --force)."),
    group_size: int = typer.Option(None, "--group-size", min=1, help="NeMo-RL: samples per prompt (default: "
                                   "consecutive samples with identical prompt tokens form a group)."),
    num_experts: int = typer.Option(None, "--num-experts", min=1, help="MoE routing: experts per layer "
                                    "(default: the largest expert id seen + 1)."),
    reward_key: str = typer.Option(None, "--reward-key", help="slime/miles: the entry of dict rewards to "
                                   "record (the run's --reward-key)."),
    model: str = typer.Option(None, "--model", help="Model name or path to record in manifest.json."),
    rollout_dtype: str = typer.Option(None, "--rollout-dtype", help="The precision the engine computed its "
                                      "logprobs in (bf16, fp16, fp8, fp32): `doctor` sizes its envelope by it "
                                      "(unstated: fp32, and a bf16 engine's rounding reads as a fault)."),
    model_dtype: str = typer.Option(None, "--model-dtype", help="The trainer's precision (bf16, fp32…)."),
    trust_pickle: bool = typer.Option(False, "--trust-pickle", help="Load pickled dumps without the allowlist "
                                      "(runs whatever code they reference: only for files you trust)."),
    force: bool = typer.Option(False, "--force", help="Replace the trace of an existing RUN."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Write an AxRL run directory from another framework's dumps through axrl.trace.Recorder;
    what the format lacks (trainer routing, per-update metrics, …) is left absent. Pickles are
    loaded by a restricted unpickler (tensors, arrays, plain containers) unless --trust-pickle."""

    def body() -> int:
        from axrl.trace import TraceError
        from axrl_debug.importers import ImportFormatError, ImportOptions, import_run

        options = ImportOptions(trust_pickle=trust_pickle, group_size=group_size, num_experts=num_experts,
                                reward_key=reward_key, rollout_dtype=rollout_dtype, model_dtype=model_dtype)
        try:
            report = import_run(format, src, run, options=options, model=model, overwrite=force)
        except (ImportFormatError, TraceError, FileExistsError) as e:
            raise BadInput(str(e)) from None
        except (NotADirectoryError, PermissionError) as e:    # RUN (or a folder above it) is a file, or read-only
            raise BadInput(f"{e.filename}: {e.strerror}: RUN must be a directory you can write") from None
        if json_out:
            print_json(report)
            return 0
        out.print(f"imported {report['format']} → {report['run']}: {len(report['steps'])} step(s) "
                  f"({report['steps'][0]}..{report['steps'][-1]}), {report['samples']} samples, "
                  f"{report['tokens']} tokens", highlight=False)
        out.print("absent (the dumps do not hold it): " + "; ".join(report["absent"]), highlight=False)
        for note in report["notes"]:
            out.print(f"note: {note}", highlight=False)
        out.print(f"next: axrl-debug summary {report['run']}", highlight=False)
        return 0

    run_command(body)
