"""`axrl model export RUN [--step N] --out DIR`: a run's checkpoint as a Hugging Face directory.

The trainer is rebuilt from the run's config.yaml exactly as `axrl train` (and replay) build it,
the checkpoint is loaded into it through the TrainBackend protocol, and `export_hf` writes
config.json, model.safetensors, generation_config.json and the run's tokenizer files: a
directory that `transformers`, SGLang and `axrl serve` load. Either backend's checkpoints work.
A LoRA run (`train.lora`) exports the merged model, or with `adapter_only` the adapters alone in
PEFT's format (`export_adapter`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from axrl.config import ConfigError, load_config
from axrl.runtime.checkpoint import list_checkpoints, load_checkpoint
from axrl.assembly.build import make_train_backend
from axrl.model import save_hf
from axrl.tokenizer import load_tokenizer
from axrl.train import TorchBackend


@dataclass
class Exported:
    out: Path
    step: int            # the checkpoint: the policy after `step` RL steps (0 = after the warm-up)
    checkpoint: Path


def export_checkpoint(run: str | Path, out: str | Path, step: int | None = None, *,
                      adapter_only: bool = False) -> Exported:
    """Write checkpoint ``step`` of ``run`` (default: the newest) to ``out`` as an HF directory
    (a LoRA run: merged), or with ``adapter_only`` its LoRA adapters in PEFT's format (`export_adapter`).

    Raises FileNotFoundError / ValueError with a message naming the run, the step or the file."""
    run, out = Path(run), Path(out)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"{run} is not a run directory (no config.yaml)")
    checkpoints = dict(list_checkpoints(run))
    if not checkpoints:
        raise FileNotFoundError(f"{run / 'checkpoints'}: no complete checkpoint to export")
    if step is None:
        step = max(checkpoints)
    if step not in checkpoints:
        raise ValueError(f"--step {step}: {run} has no checkpoint step_{step:06d}; checkpoints: "
                         f"{', '.join(map(str, sorted(checkpoints)))} (step N = the policy after N RL steps)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty; choose a new directory")
    try:
        cfg = load_config(run / "config.yaml")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if adapter_only and cfg.train.lora is None:
        raise ValueError(f"--adapter-only: {run} trained no LoRA adapters (train.lora is null); "
                         "export the whole model without --adapter-only")
    tokenizer = load_tokenizer(cfg.model.path)
    backend = make_train_backend(cfg, tokenizer)
    try:
        load_checkpoint(checkpoints[step], backend)
        if adapter_only:
            assert isinstance(backend, TorchBackend)  # the config allows train.lora on the torch backend only
            export_adapter(backend, cfg.model.path, out)
        else:
            backend.export_hf(out)
    finally:
        backend.close()
    return Exported(out=out, step=step, checkpoint=checkpoints[step])


def export_adapter(backend: TorchBackend, model_path: str | None, out: Path) -> None:
    """The adapters in PEFT's format into ``out``, for the run's base model: ``model.path`` when the run
    started from one, else (a random-init preset) the base weights themselves, written to ``out/base``."""
    if model_path is not None:
        backend.export_adapter(out, base_model=str(Path(model_path).resolve()))
        return
    base = out / "base"
    save_hf(backend.model, base, backend.tokenizer)   # the frozen base: the model without its adapters
    backend.export_adapter(out, base_model=str(base.resolve()))
