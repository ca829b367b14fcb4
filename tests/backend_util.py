"""Train-backend helpers shared by the tests: a random packed batch and a torch backend on a
random-init model (the Megatron, LoRA, prefix-merge and Ray tests build theirs from these)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from axrl.model import ModelConfig, build_model, preset_config
from axrl.train import PackedBatch, TorchBackend, TorchBackendConfig

LENGTHS = [5, 9, 3, 12, 7]


def make_batch(lengths: Sequence[int] = LENGTHS, seed: int = 0, temperature: float = 1.0,
               vocab: int = 1024) -> PackedBatch:
    """Samples of `lengths` tokens: random ids below `vocab`, ~80 % of the tokens trained (never a
    sample's first: it has no prediction), random advantages; the same batch for the same seed."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    loss_mask = (torch.rand(T, generator=g) < 0.8).float()
    loss_mask[offsets[:-1]] = 0.0  # position 0 of a sample has no prediction
    return PackedBatch(input_ids=torch.randint(0, vocab, (T,), generator=g), offsets=offsets, loss_mask=loss_mask,
                       advantages=torch.randn(T, generator=g), temperature=temperature)


def make_backend(model: str | ModelConfig = "micro-moe", model_seed: int = 0, **cfg: Any) -> TorchBackend:
    """A `TorchBackend` on a random-init model (a preset name or a `ModelConfig`, seeded with
    `model_seed`), lr 1e-2 on one thread unless `cfg` says otherwise."""
    model_cfg = preset_config(model) if isinstance(model, str) else model
    cfg = {"lr": 1e-2, "num_threads": 1, **cfg}
    return TorchBackend(build_model(model_cfg, seed=model_seed), TorchBackendConfig(**cfg))
