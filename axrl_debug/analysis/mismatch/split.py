"""Δ = Δ_engine + Δ_staleness, from ``/tokens/behaviour_train_logprob`` (the trainer's logprob
under the weights that generated the token): Δ_engine = behaviour_train − rollout is the
engine/trainer mismatch at equal weights, Δ_staleness = old − behaviour_train the policy drift
(``axrl.trace.quantities``). Both paths of the analysis fold the same sums through ``split_sums``.

Over a set of split tokens (analysed, with a finite behaviour_train_logprob) the report gives the
count, mean |Δ| and mean Δ, and for each part its mean |·|, mean and ``abs_share``:

    abs_share(part) = Σ sign(Δ)·part / Σ |Δ|

the part's exact share of the headline Σ|Δ|: |Δ| = sign(Δ)·Δ_engine + sign(Δ)·Δ_staleness token by
token, so the two shares add up to 1. A part that pushes against Δ has a negative share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from axrl.trace.quantities import split_deltas

# The sums kept per group of tokens (a block, a step, a version-lag bucket, the run), in this order.
_FIELDS = ("tokens", "abs", "sum", "engine_abs", "engine_sum", "engine_proj",
           "staleness_abs", "staleness_sum", "staleness_proj")
_SIZE = len(_FIELDS)

# (sums, {lag: sums}) of one block: what a path hands the accumulator
BlockSplit = tuple[np.ndarray, "dict[int, np.ndarray] | None"]


def split_sums(d: np.ndarray, r: np.ndarray, o: np.ndarray, b: np.ndarray,
               lag: np.ndarray | None = None) -> BlockSplit:
    """The split sums of analysed tokens (``d`` = Δ in float64; ``r``, ``o``, ``b`` their rollout,
    old and behaviour_train logprobs; ``lag`` their version lag, for the per-lag sums) over those
    with a finite ``b``."""
    keep = np.isfinite(b)
    if not keep.all():
        d, r, o, b = d[keep], r[keep], o[keep], b[keep]
        lag = None if lag is None else lag[keep]
    engine, stale = split_deltas(r, o, b)
    sign = np.sign(d)
    terms = (None, np.abs(d), d, np.abs(engine), engine, sign * engine, np.abs(stale), stale, sign * stale)
    total = np.array([d.size] + [float(x.sum()) for x in terms[1:]], dtype=np.float64)
    if lag is None:
        return total, None
    by_lag: dict[int, np.ndarray] = {}
    if d.size:
        lo = int(lag.min())
        key = (lag - lo).astype(np.intp)
        size = int(key.max()) + 1
        cols = np.stack([np.bincount(key, minlength=size).astype(np.float64)]
                        + [np.bincount(key, weights=x, minlength=size) for x in terms[1:]])
        for j in np.flatnonzero(cols[0]):
            by_lag[lo + int(j)] = cols[:, j].copy()
    return total, by_lag


@dataclass
class SplitSums:
    """The split sums of the tokens folded in so far: overall and per version lag."""

    total: np.ndarray = field(default_factory=lambda: np.zeros(_SIZE))
    by_lag: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, part: BlockSplit) -> None:
        total, by_lag = part
        self.total += total
        for lag, sums in (by_lag or {}).items():
            self.by_lag.setdefault(lag, np.zeros(_SIZE))[:] += sums

    def merge(self, other: "SplitSums") -> None:
        self.add((other.total, other.by_lag))

    def lag(self, lag: int) -> dict[str, Any]:
        """``split_figures`` of one version-lag bucket (zero tokens when none had the column)."""
        return split_figures(self.by_lag.get(lag, np.zeros(_SIZE)))


def split_figures(sums: np.ndarray) -> dict[str, Any]:
    """The report of one group's split sums: ``tokens``, ``mean_abs`` and ``mean`` of Δ, and
    ``engine`` / ``staleness`` each with ``mean_abs``, ``mean`` and ``abs_share`` (NaN without tokens)."""
    n, total_abs = float(sums[0]), float(sums[1])

    def mean(i: int) -> float:
        return float(sums[i]) / n if n else math.nan

    def part(i: int) -> dict[str, float]:
        return {"mean_abs": mean(i), "mean": mean(i + 1),
                "abs_share": float(sums[i + 2]) / total_abs if total_abs > 0 else math.nan}

    return {"tokens": int(n), "mean_abs": mean(1), "mean": mean(2),
            "engine": part(_FIELDS.index("engine_abs")), "staleness": part(_FIELDS.index("staleness_abs"))}


def split_head(sums: np.ndarray) -> dict[str, Any]:
    """A step's split as flat per-step keys (``per_step`` rows, the step table)."""
    f = split_figures(sums)
    return {"split_tokens": f["tokens"],
            "engine_mean_abs": f["engine"]["mean_abs"], "engine_mean": f["engine"]["mean"],
            "staleness_mean_abs": f["staleness"]["mean_abs"], "staleness_mean": f["staleness"]["mean"]}
