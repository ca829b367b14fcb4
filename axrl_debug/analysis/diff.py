"""Step-aligned comparison of two runs' step tables, and the tolerance rule shared with the gate.

Two values a (run/golden under test) and b (reference) are *close* when

    |a − b| ≤ atol + rtol · |b|          (numpy.isclose's rule, b the reference)

with NaN close to NaN and an infinity close only to the same infinity — so a metric that is NaN
in both runs (e.g. routing agreement of a dense model) never counts as a divergence.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

# What diff compares by default: the trainer's scalars, the mismatch scalars and token counts.
DEFAULT_DIFF_METRICS = ("reward", "loss", "grad_norm", "clipfrac", "mismatch", "mismatch_max", "kl_k3",
                        "routing_agreement", "version_lag_mean", "tokens", "generated_tokens")


def is_close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """The tolerance rule (module docstring); non-numbers are compared with ==."""
    try:
        fa, fb = float(a), float(b)
    except (TypeError, ValueError):
        return a == b
    if math.isnan(fa) or math.isnan(fb):
        return math.isnan(fa) and math.isnan(fb)
    if math.isinf(fa) or math.isinf(fb):
        return fa == fb
    return abs(fa - fb) <= atol + rtol * abs(fb)


def rel_diff(a: float, b: float) -> float:
    """|a − b| / |b| (inf when b = 0 ≠ a, 0 when both 0, NaN when either is NaN)."""
    try:
        fa, fb = float(a), float(b)
    except (TypeError, ValueError):
        return math.nan
    if math.isnan(fa) or math.isnan(fb):
        return math.nan
    d = abs(fa - fb)
    if d == 0:
        return 0.0
    return d / abs(fb) if fb != 0 else math.inf


def diff_tables(a: pd.DataFrame, b: pd.DataFrame, metrics: Iterable[str], rtol: float, atol: float,
                tokens_equal: dict[int, bool] | None = None) -> dict[str, Any]:
    """Compare run A with reference run B step by step. Returns per-step rows, the first diverging
    step (a metric beyond tolerance), the first step whose weights fingerprints differ and the first
    whose sampled tokens differ (when ``tokens_equal`` is given)."""
    metrics = [m for m in metrics if m in a.columns and m in b.columns]
    ia, ib = a.set_index("step"), b.set_index("step")
    common = sorted(set(ia.index) & set(ib.index))
    rows: list[dict[str, Any]] = []
    first = first_fp = first_tok = None
    for s in common:
        moved = []
        for m in metrics:
            va, vb = ia.at[s, m], ib.at[s, m]
            if not is_close(va, vb, rtol, atol):
                moved.append({"metric": m, "a": _num(va), "b": _num(vb),
                              "abs_diff": abs(float(va) - float(vb)) if _isnum(va) and _isnum(vb) else math.nan,
                              "rel_diff": rel_diff(va, vb)})
        fa = ia.at[s, "weights_fingerprint_after"] if "weights_fingerprint_after" in ia.columns else None
        fb = ib.at[s, "weights_fingerprint_after"] if "weights_fingerprint_after" in ib.columns else None
        fp_equal = None if not (isinstance(fa, str) and isinstance(fb, str)) else fa == fb
        tok_equal = None if tokens_equal is None else tokens_equal.get(s)
        if moved and first is None:
            first = s
        if fp_equal is False and first_fp is None:
            first_fp = s
        if tok_equal is False and first_tok is None:
            first_tok = s
        rows.append({"step": s, "diverged": bool(moved), "moved": moved, "weights_equal": fp_equal,
                     "tokens_equal": tok_equal})
    return {
        "metrics": metrics, "rtol": rtol, "atol": atol, "common_steps": len(common),
        "only_in_a": sorted(set(ia.index) - set(ib.index)), "only_in_b": sorted(set(ib.index) - set(ia.index)),
        "first_divergence": first, "first_weights_divergence": first_fp, "first_token_divergence": first_tok,
        "diverged_steps": sum(r["diverged"] for r in rows), "steps": rows,
    }


def _isnum(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _num(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v
