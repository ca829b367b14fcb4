"""Which parameter tensors — and which decoder layers — carried a step's gradient, from the
trace's per-update, per-tensor gradient norms (`/train/param_grad_norm` [U, P],
`/train/param_names` [P]; one norm per tensor, recorded for every update).

For step s, tensor p: n_p(s) = max over the step's updates of ‖∇_p‖. Its baseline is the median
of n_p over the `window` steps before s that recorded it; ratio = n_p(s) / baseline. A layer
groups its tensors (`model.layers.{i}.…`; embeddings, final norm and LM head are their own
groups) with ‖∇_layer‖ = sqrt(Σ_p n_p²); share = ‖∇_layer‖² / Σ_layers ‖∇_layer‖².
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from axrl.trace import TraceReader

COLUMNS = ["/train/param_names", "/train/param_grad_norm"]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> str:
    """The group of a parameter tensor: 'layers.N' for decoder layers, else its own name."""
    m = _LAYER.match(name)
    if m:
        return f"layers.{m.group(1)}"
    return name.removeprefix("model.").removesuffix(".weight")


def _per_tensor(cols: dict[str, Any]) -> dict[str, float]:
    names = [str(n) for n in cols["/train/param_names"]]
    norms = np.asarray(cols["/train/param_grad_norm"], dtype=np.float64)
    peak = norms.max(axis=0) if norms.size else np.zeros(len(names))
    return dict(zip(names, peak.tolist()))


def _groups(per: dict[str, float]) -> dict[str, float]:
    sq: dict[str, float] = {}
    for name, v in per.items():
        sq[layer_of(name)] = sq.get(layer_of(name), 0.0) + v * v
    return {k: math.sqrt(v) for k, v in sq.items()}


def _rows(now: dict[str, float], history: list[dict[str, float]], key: str, top: int) -> list[dict[str, Any]]:
    total = sum(v * v for v in now.values())
    rows = []
    for name, v in now.items():
        past = [h[name] for h in history if name in h and math.isfinite(h[name])]
        base = float(np.median(past)) if past else math.nan
        rows.append({key: name, "grad_norm": v, "baseline": base,
                     "ratio": v / base if past and base > 0 else math.nan,
                     "share": v * v / total if total > 0 else math.nan})
    rows.sort(key=lambda r: -r["grad_norm"])
    return rows[:top]


def gradient_attribution(reader: TraceReader, step: int, *, window: int = 10, top: int = 5) -> dict[str, Any] | None:
    """The layers and tensors with the largest gradient at `step`, against their own recent
    history (module docstring); None when the step did not record per-tensor norms."""
    before = [s for s in reader.steps if s < step][-window:]
    history: list[dict[str, float]] = []
    current = None
    for sc in reader.iter_columns([], before + [step], optional=COLUMNS):
        if "/train/param_grad_norm" not in sc:
            continue
        per = _per_tensor(sc.data)
        if sc.step == step:
            current = per
        else:
            history.append(per)
    if current is None:
        return None
    return {"history_steps": len(history),
            "layers": _rows(_groups(current), [_groups(h) for h in history], "layer", top),
            "tensors": _rows(current, history, "tensor", top)}
