"""The `axrl` command line: `axrl train`, `axrl serve`, and model utilities
(`axrl model init|export|info|check-template`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from axrl.cli.help import Typer

app = Typer(help="AxRL: agentic RL post-training with a replayable trace.", no_args_is_help=True,
                  add_completion=False)
model_app = Typer(help="Create, export and inspect models (Hugging Face format).", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console(stderr=True)


def fail(message: str) -> "typer.Exit":
    """Print a bad-input error and return the exit (code 2) to raise."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


@app.command("train")
def train(
    config: Path = typer.Argument(..., help="YAML config, e.g. examples/quickstart.yaml."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: --set rollout.group_size=4 (repeatable)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Where the trace, metrics and checkpoints go "
                                        "(default: runs/<config name>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest checkpoint."),
) -> None:
    """Train a policy with RL; every step is recorded to RUN_DIR/trace for axrl-debug."""
    from axrl.config import ConfigError, load_config

    try:
        if resume:
            if run_dir is None:
                raise ConfigError("--resume needs --run-dir")
            from axrl.assembly.resume import resume_config

            plan = resume_config(run_dir, config, set_)
            for note in plan.notes:
                console.print(note, soft_wrap=True)  # a folded path cannot be copied back
            cfg = plan.cfg
        else:
            cfg = load_config(config, set_)
    except ConfigError as e:
        raise fail(str(e))
    from axrl.assembly.build import train as run_training

    target = run_dir or Path("runs") / config.stem
    try:
        out = run_training(cfg, target, resume=resume)
    except (FileExistsError, FileNotFoundError, ValueError, NotImplementedError) as e:
        raise fail(str(e))
    console.print(f"[bold green]done[/]: trace, metrics and checkpoints in {out}  "
                  f"(inspect with `axrl-debug summary {out}`)")


@app.command("status")
def status(
    run_dir: Path = typer.Argument(..., help="A run directory."),
    events: int = typer.Option(10, "--events", help="How many of the latest events to show."),
) -> None:
    """Show a run's actors (state, heartbeat, current work, errors) and its fault/recovery events."""
    from axrl.runtime.recording.events import read_events
    from axrl.ray_executor.monitor import read_status

    if not (run_dir / "config.yaml").is_file():
        raise fail(f"{run_dir} is not a run directory (no config.yaml)")
    out = Console() if Console().is_terminal else Console(width=140)
    snapshot = read_status(run_dir)
    if snapshot is None:
        out.print("no actor heartbeats (RUN/status.json): a runtime.executor: local run, or not started yet")
    else:
        import time

        from axrl.console.health_table import health_table

        table = health_table(snapshot["actors"], snapshot["time"],
                             title=f"actors, {time.time() - snapshot['time']:.0f} s ago")
        out.print(table)
    recorded = read_events(run_dir)
    out.print(f"events: {len(recorded)}" + (f" (latest {events})" if len(recorded) > events else ""))
    for e in recorded[-events:]:
        shown = {k: ([str(n)[:8] for n in v] if k == "nodes" else v) for k, v in e.items()
                 if k not in ("time", "event", "component", "reason", "requeued_rids")}
        details = ", ".join(f"{k}={v}" for k, v in shown.items())
        out.print(f"  {e['time'][:19]}  {e['event']:<20} {e.get('component', '')}  {details}")


@app.command("serve")
def serve(
    model_path: Path = typer.Option(..., "--model-path", help="HF model directory (e.g. from `axrl model init`)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(30000, "--port"),
    max_running_requests: int = typer.Option(64, "--max-running-requests", "--max-batch-size",
                                             help="Engine slots: sequences decoded together."),
    context_length: int = typer.Option(1024, "--context-length", "--max-seq-len",
                                       help="Longest prompt + output a request may reach."),
    enable_return_routed_experts: bool = typer.Option(False, "--enable-return-routed-experts",
                                                      help="Allow return_routed_experts (R3)."),
    random_seed: int = typer.Option(0, "--random-seed", help="Seed of requests without a sampling_seed."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    served_model_name: str | None = typer.Option(None, "--served-model-name"),
    weight_version: str = typer.Option("0", "--weight-version", help="Version of the weights loaded at start."),
    decode_impl: str = typer.Option("fused", "--decode-impl", help="fused or model (see docs/engines.md)."),
    disable_radix_cache: bool = typer.Option(False, "--disable-radix-cache",
                                             help="Turn off the engine's prefix cache (docs/prefix-merge.md)."),
    threads: int = typer.Option(1, "--threads", help="torch threads of the engine."),
    log_level: str = typer.Option("warning", "--log-level"),
    training: bool = typer.Option(False, "--training", help="Also serve the Tinker training API (docs/service.md)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="--training: the run directory it records into."),
    config: Path | None = typer.Option(None, "--config", help="--training: run config (train, runtime, trace)."),
    overrides: list[str] = typer.Option([], "--set", help="--training: config override key=value (repeatable)."),
    full_finetune: bool = typer.Option(False, "--full-finetune",
                                       help="--training: train all weights even when a client asks for LoRA."),
) -> None:
    """Serve a model over HTTP with SGLang's API subset and OpenAI endpoints (see docs/sglang.md); with
    --training also the Tinker training and sampling API, every optim_step recorded (docs/service.md)."""
    from axrl.runtime.checkpoint import checkpoint_of

    trained = checkpoint_of(model_path)
    if trained is not None:
        run, step = trained
        raise fail(f"--model-path {model_path} is a training checkpoint, not a model directory: export it with "
                   f"`axrl model export {run} --step {step} --out DIR` and serve DIR")
    if not (model_path / "config.json").is_file():
        raise fail(f"--model-path {model_path}: no config.json (a Hugging Face model directory: one written by "
                   "`axrl model export RUN --out DIR`, `axrl model init` or transformers' save_pretrained)")
    if dtype not in ("float32", "bfloat16"):
        raise fail(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if decode_impl not in ("fused", "model"):
        raise fail(f"--decode-impl {decode_impl!r}: choose fused or model")
    if max_running_requests < 1 or context_length < 2 or threads < 1:
        raise fail("--max-running-requests and --threads must be >= 1, --context-length >= 2")
    if training != (run_dir is not None) or (config is not None or overrides or full_finetune) and not training:
        raise fail("--training needs --run-dir RUN (and --run-dir, --config, --set need --training)")
    from axrl.inference.serve import ServeConfig
    from axrl.inference.serve import serve as run_server

    if training:
        _serve_training(model_path, run_dir, config, overrides, full_finetune, ServeConfig(
            model_path=str(model_path), host=host, port=port, max_running_requests=max_running_requests,
            context_length=context_length, random_seed=random_seed, dtype=dtype,
            served_model_name=served_model_name, decode_impl=decode_impl, disable_radix_cache=disable_radix_cache,
            threads=threads, log_level=log_level))
        return
    try:
        run_server(ServeConfig(
            model_path=str(model_path), host=host, port=port, max_running_requests=max_running_requests,
            context_length=context_length, enable_return_routed_experts=enable_return_routed_experts,
            random_seed=random_seed, dtype=dtype, served_model_name=served_model_name, weight_version=weight_version,
            decode_impl=decode_impl, disable_radix_cache=disable_radix_cache, threads=threads,
            log_level=log_level))
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e))


def _serve_training(model_path: Path, run_dir: Path | None, config: Path | None, overrides: list[str],
                    full_finetune: bool, serve_cfg: object) -> None:
    """`axrl serve --training`: the serve app plus the Tinker API (axrl/tinker_api/)."""
    from axrl.config import ConfigError, load_config
    from axrl.assembly.tinker_api import serve_training

    assert run_dir is not None
    try:
        serve_training(serve_cfg, load_config(config, overrides), run_dir,  # type: ignore[arg-type]
                       full_finetune=full_finetune)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        raise fail(str(e))


@model_app.command("init")
def model_init(
    preset: str = typer.Option(..., "--preset", help="Model preset: tiny-moe, tiny-dense or micro-moe."),
    out: Path = typer.Option(..., "--out", help="Directory to write (config.json, model.safetensors, tokenizer)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random initialisation."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
) -> None:
    """Write a randomly initialised model as a Hugging Face directory (loads in transformers and SGLang)."""
    import torch

    from axrl.model import PRESETS, build_model, preset_config, save_hf
    from axrl.tokenizer import Tokenizer

    if preset not in PRESETS:
        raise fail(f"--preset {preset!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}")
    if dtype not in ("float32", "bfloat16"):
        raise fail(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if out.exists() and any(out.iterdir()):
        raise fail(f"--out {out} exists and is not empty; choose a new directory")
    tokenizer = Tokenizer.default()
    cfg = preset_config(preset, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = build_model(cfg, seed=seed, dtype=getattr(torch, dtype))
    save_hf(model, out, tokenizer=tokenizer)
    console.print(f"wrote {preset} ({model.num_parameters() / 1e6:.2f}M parameters, {cfg.model_type}) to {out}")


@model_app.command("export")
def model_export(
    run: Path = typer.Argument(..., help="Run directory (from `axrl train`)."),
    out: Path = typer.Option(..., "--out", help="Directory to write (config.json, model.safetensors, tokenizer)."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint to export: the policy after N RL steps "
                                    "(default: the newest checkpoint)."),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="A LoRA run (train.lora): write only its "
                                      "adapters in PEFT's format (adapter_config.json + adapter_model.safetensors; "
                                      "a preset run's base model goes to OUT/base). Default: the merged model."),
) -> None:
    """Write a trained checkpoint as a Hugging Face directory that transformers, SGLang and
    `axrl serve` load (a LoRA run: the merged model, or its adapters alone with --adapter-only)."""
    from axrl.cli.export import export_checkpoint

    try:
        done = export_checkpoint(run, out, step, adapter_only=adapter_only)
    except (FileNotFoundError, FileExistsError, ValueError, NotImplementedError) as e:
        raise fail(str(e))
    if adapter_only:
        console.print(f"wrote the LoRA adapters of {done.checkpoint} (after {done.step} RL steps) to {done.out} "
                      "in PEFT's format (PeftModel.from_pretrained on the base model in its adapter_config.json)")
        return
    console.print(f"wrote {done.checkpoint} (the policy after {done.step} RL steps) to {done.out}; "
                  f"serve it with `axrl serve --model-path {done.out}`")


@model_app.command("info")
def model_info(path: Path = typer.Argument(..., help="An HF model directory.")) -> None:
    """Print a model directory's architecture and parameter count."""
    from axrl.model import load_hf

    try:
        model = load_hf(path)
    except (FileNotFoundError, ValueError) as e:
        raise fail(str(e))
    cfg = model.config
    console.print(f"{cfg.model_type}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                  f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), "
                  f"experts {cfg.num_experts} (top-{cfg.num_experts_per_tok if cfg.is_moe else 0}), "
                  f"vocab {cfg.vocab_size}, {model.num_parameters() / 1e6:.2f}M parameters")


@model_app.command("check-template")
def model_check_template(path: Path = typer.Argument(..., help="An HF model directory (or a tokenizer directory).")) -> None:
    """Check that AxRL can follow a directory's chat template: run the load-time probes, compare
    its rendering of a sample agent conversation with transformers' apply_chat_template, and say
    what AxRL does with it (turn end, tool-call format and parser, system role, drift). Exit 2 on a
    refusal or a rendering that differs from transformers' (the verdict quotes the template's own
    error); never a traceback, whatever the template raises."""
    from axrl.tokenizer.template_report import check_template

    report = check_template(path)
    for line in report.lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(2)

