"""Combining per-micro-batch loss metrics into batch metrics, and the per-token columns a loss
function may return beside them.

The LossFn contract: a loss function normalises its metrics by batch-wide counts (LossContext),
so most of them are *summed* over the micro-batches of one optimizer batch. Keys ending in "_max" / "_min" are extremes and combine
with max / min instead. Keys starting with `TOKEN_COLUMN_PREFIX` are not scalars but per-token
columns [T_mb] of the micro-batch; backends concatenate them in batch order into
`TrainMetrics.tokens`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["TOKEN_COLUMN_PREFIX", "reduce_microbatch_metrics", "split_token_columns", "join_token_columns"]

TOKEN_COLUMN_PREFIX = "tokens/"


def reduce_microbatch_metrics(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Batch metrics from micro-batch rows: sum, except "*_max" → max and "*_min" → min.

    A key missing from some rows is reduced over the rows that have it; per-token columns
    (`TOKEN_COLUMN_PREFIX` keys) are not scalars and are left out.
    """
    out: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(TOKEN_COLUMN_PREFIX):
                continue
            v = float(value)
            if key not in out:
                out[key] = v
            elif key.endswith("_max"):
                out[key] = max(out[key], v)
            elif key.endswith("_min"):
                out[key] = min(out[key], v)
            else:
                out[key] += v
    return out


def split_token_columns(metrics: Mapping[str, Any], num_tokens: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A loss function's metrics → (scalar metrics as floats, per-token columns as CPU tensors
    keyed without the prefix). A column must be 1-D with `num_tokens` rows (ValueError otherwise)."""
    scalars: dict[str, float] = {}
    columns: dict[str, torch.Tensor] = {}
    for key, value in metrics.items():
        if key.startswith(TOKEN_COLUMN_PREFIX):
            name = key[len(TOKEN_COLUMN_PREFIX):]
            if not isinstance(value, torch.Tensor) or value.shape != (num_tokens,):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"loss metric {key!r} must be a tensor of shape [{num_tokens}] (one value per "
                                 f"token of the micro-batch), got {shape}")
            columns[name] = value.detach().cpu()
        else:
            scalars[key] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    return scalars, columns


def join_token_columns(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-micro-batch columns (in batch order) → one [T] column per name; a name every part
    does not carry is left out (its rows would be unknown)."""
    if not parts:
        return {}
    names = [n for n in parts[0] if all(n in p for p in parts)]
    return {n: torch.cat([p[n] for p in parts]) for n in names}
