"""A train backend's checkpoint on disk, shared by both backends (one backend's checkpoint loads
into the other): model / optimizer / RNG safetensors and `trainer_state.json`, never a pickle, each
file validated before any state changes. The state itself is the backends' `state_dict` layout
(HF names, AdamW moments per parameter, schedule counters, RNG, config)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load_file, save_file

from axrl.train.determinism import RngState
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.settings import BackendConfig

CHECKPOINT_FORMAT = "axrl-torch-backend"   # the embedded backend's format, which every backend writes
CHECKPOINT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE = (
    "model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json")
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
_CHECKPOINT_FILES = f"{MODEL_FILE}, {OPTIMIZER_FILE}, {RNG_FILE} and {STATE_FILE}"


def write_checkpoint(directory: str | Path, state: dict[str, Any]) -> None:
    """Write a backend's `state_dict()` as model/optimizer/rng safetensors and trainer_state.json
    (written last: its presence marks a complete checkpoint). Each file goes to *.tmp, then is renamed."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng: RngState = state["rng"]
    optim = {f"{name}.{k}": v.contiguous() for name, s in state["optimizer"].items() for k, v in s.items()}
    _atomic(d / MODEL_FILE, lambda p: save_file(state["model"], p, metadata={"format": "pt"}))
    _atomic(d / OPTIMIZER_FILE, lambda p: save_file(optim, p, metadata={"format": "axrl-adamw"}))
    _atomic(d / RNG_FILE, lambda p: save_file(rng.tensors, p))
    meta = {
        "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
        "scheduler_step": state["scheduler_step"], "skipped_steps": state["skipped_steps"],
        "weights_fingerprint": weights_fingerprint(state["model"]),
        "config": state["config"], "rng": rng.meta,
        "num_threads": torch.get_num_threads(), "torch_version": torch.__version__,
    }
    _atomic(d / STATE_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=1) + "\n"))


def read_checkpoint(directory: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A `write_checkpoint` directory as (state in the `state_dict` layout, the file each part came
    from, for error messages). The weights are checked against the recorded fingerprint; never unpickles."""
    d = Path(directory)
    state_path = d / STATE_FILE
    meta = _read_json(state_path)
    if meta.get("format") != CHECKPOINT_FORMAT or meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{state_path}: not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} checkpoint "
                         f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
    try:
        scheduler_step, skipped, fp, config, rng_meta = (
            int(meta["scheduler_step"]), int(meta.get("skipped_steps", 0)), str(meta["weights_fingerprint"]),
            dict(meta["config"]), dict(meta["rng"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{state_path}: missing or malformed field ({e!r})") from e
    model = _read_safetensors(d / MODEL_FILE)
    if weights_fingerprint(model) != fp:
        raise ValueError(f"{d / MODEL_FILE}: weights do not match the fingerprint recorded in "
                         f"{STATE_FILE} (corrupt file or files from different checkpoints)")
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _read_safetensors(d / OPTIMIZER_FILE).items():
        name, _, entry = key.rpartition(".")
        optim.setdefault(name, {})[entry] = t
    rng = RngState(tensors=_read_safetensors(d / RNG_FILE), meta=rng_meta)
    state = {"model": model, "optimizer": optim, "scheduler_step": scheduler_step, "skipped_steps": skipped,
             "rng": rng, "config": config}
    sources = {"model": str(d / MODEL_FILE), "optimizer": str(d / OPTIMIZER_FILE),
               "rng": f"{d / RNG_FILE} + {STATE_FILE}", "config": str(state_path)}
    return state, sources


def check_optimizer_state(params: Mapping[str, torch.Tensor], optim: dict[str, dict[str, torch.Tensor]],
                          source: str) -> None:
    """Validate optimizer state against the (HF name → weight) `params` before touching anything:
    all params or none (before the first update), AdamW's entries, the parameters' shapes."""
    unknown = sorted(set(optim) - set(params))
    missing = sorted(set(params) - set(optim)) if optim else []
    if unknown or missing:
        raise ValueError(f"{source}: optimizer state does not match the model's parameters "
                         f"(unknown {unknown[:5]}, missing {missing[:5]})")
    for name, s in optim.items():
        if set(s) != set(ADAM_KEYS):
            raise ValueError(f"{source}: '{name}' has optimizer entries {sorted(s)}, expected {list(ADAM_KEYS)}")
        for k in ("exp_avg", "exp_avg_sq"):
            if tuple(s[k].shape) != tuple(params[name].shape):
                raise ValueError(f"{source}: '{name}.{k}' has shape {tuple(s[k].shape)}, "
                                 f"the parameter has {tuple(params[name].shape)}")


def warn_config_diff(config: BackendConfig, saved: dict[str, Any], source: str) -> None:
    """Warn when a checkpoint's config differs from the current one. Call it straight from the
    backend's state loader: the warning points at that loader's caller (stacklevel 3)."""
    # The current config wins (a resume may change e.g. lr on purpose), but a silent change
    # breaks bitwise continuation, so say so.
    current = config.to_dict()
    # A common field the checkpoint predates (e.g. prefix_merge) had its default then; fields
    # of one backend only (Megatron's layout) still show up when moving between backends.
    saved = {**BackendConfig().to_dict(), **saved}
    diff = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)}
    if diff:
        warnings.warn(f"{source}: checkpoint config differs from the current one (saved, current): {diff}",
                      stacklevel=3)


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a TorchBackend checkpoint needs {_CHECKPOINT_FILES}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a TorchBackend checkpoint needs {_CHECKPOINT_FILES}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
