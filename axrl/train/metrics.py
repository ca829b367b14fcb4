"""Combining per-micro-batch loss metrics into batch metrics.

The LossFn contract: a loss function normalises its metrics by batch-wide counts (LossContext),
so most of them are *summed* over the micro-batches of one optimizer batch. Keys ending in "_max" / "_min" are extremes and combine
with max / min instead.
"""

from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["reduce_microbatch_metrics"]


def reduce_microbatch_metrics(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Batch metrics from micro-batch rows: sum, except "*_max" → max and "*_min" → min.

    A key missing from some rows is reduced over the rows that have it.
    """
    out: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
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
