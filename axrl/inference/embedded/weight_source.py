"""Reading and checking what `EmbeddedEngine.update_weights` is given, before anything is copied:
a bad update must never leave the engine with half-copied weights."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict, load_config
from axrl.model.io import WEIGHTS_NAME

# Config fields that do not change the computation; an update from a directory may differ there.
NON_ARCH_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_position_embeddings"}


def load_weight_source(source: Any, config: ModelConfig,
                       expected_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The HF-named state dict of `source` — a state dict, an HF model directory (its config must
    describe the same architecture as `config`) or a `Qwen3ForCausalLM` — checked against
    `expected_shapes`; ValueError (or FileNotFoundError) says what does not match."""
    if isinstance(source, Qwen3ForCausalLM):
        source = hf_state_dict(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        cfg = load_config(path)
        diff = [f.name for f in fields(ModelConfig) if f.name not in NON_ARCH_FIELDS
                and getattr(cfg, f.name) != getattr(config, f.name)]
        if diff:
            raise ValueError(f"{path}: config.json does not match the engine's model (fields {diff})")
        if not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{path / WEIGHTS_NAME} not found")
        return check_state_dict(load_file(str(path / WEIGHTS_NAME)), expected_shapes, str(path))
    if isinstance(source, Mapping):
        return check_state_dict(dict(source), expected_shapes, "state dict")
    raise ValueError(f"update_weights source must be a state dict, a model directory or a model, "
                     f"got {type(source).__name__}")


def check_state_dict(sd: dict[str, torch.Tensor], expected_shapes: Mapping[str, tuple[int, ...]],
                     where: str) -> dict[str, torch.Tensor]:
    """`sd` itself once every expected name is there with its shape (an extra `lm_head.weight`
    is allowed: tied embeddings); `where` names the source in the error."""
    missing = sorted(set(expected_shapes) - set(sd))
    unexpected = sorted(set(sd) - set(expected_shapes) - {"lm_head.weight"})
    if missing or unexpected:
        raise ValueError(f"{where}: weight names do not match the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    for name, shape in expected_shapes.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{where}: '{name}' has shape {tuple(sd[name].shape)}, expected {shape}")
    return sd
