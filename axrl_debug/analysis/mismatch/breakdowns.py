"""Breakdown tables: joint histograms of the breakdown digits (one bin index per token over every
breakdown at once), their marginals, and the per-bucket count / Σ|Δ| / ΣΔ they add up to."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .scratch import _Scratch


_JOINT_LIMIT = 1 << 17   # bins of one joint histogram (counts and sums stay in L2)

# A breakdown dimension: (name, digit per row in [0, size), size, key of digit 0 for keyed
# breakdowns (turn, lag: digit j is key lo + j) or None for the fixed-label ones).
_Dim = tuple[str, np.ndarray, int, "int | None"]
# The identity of a joint histogram: its dimensions as (name, size, lo).
_Sig = tuple[tuple[str, int, "int | None"], ...]


def _group_dims(sizes: list[int]) -> list[list[int]]:
    """Split breakdown dimensions (their sizes, in order) into consecutive groups whose joint
    histogram (× 3 classes) has at most ``_JOINT_LIMIT`` bins."""
    groups: list[list[int]] = []
    cur: list[int] = []
    prod = 1
    for i, size in enumerate(sizes):
        if cur and prod * size * 3 > _JOINT_LIMIT:
            groups.append(cur)
            cur, prod = [], 1
        cur.append(i)
        prod *= size
    if cur:
        groups.append(cur)
    return groups


def _joint_hist(dims: list[_Dim], cls: np.ndarray, weights: np.ndarray,
                ws: _Scratch | None = None) -> list[tuple[_Sig, np.ndarray, np.ndarray]]:
    """Joint histograms of the breakdown digits: [(signature, counts, Δ sums)], the arrays flat
    over the cells of ``signature``'s dimensions × 3 classes.

    ``cls`` is 0 (analysed, Δ ≥ 0), 1 (analysed, Δ < 0) or 2 (not analysed: kept out of every
    figure) per row and ``weights`` the Δ of each row. The digits are combined into one bin index
    per row (mixed radix, in the narrowest integer type that holds it so far), so a whole set of
    breakdowns costs two bincounts instead of two per breakdown; each breakdown's count, S⁺ and S⁻
    are marginals of the cells (``_marginals``), taken once per run rather than per step.
    Dimensions are grouped by ``_group_dims``. (The compiled path, ``compiled.compiled_block``,
    builds the same histograms in one compiled pass: ``kernels.breakdown_block``.)"""
    ws = ws or _Scratch()
    n = cls.shape[0]
    out = []
    for g in _group_dims([dim[2] for dim in dims]):
        sizes = [dims[i][2] for i in g] + [3]
        digits = [dims[i][1] for i in g] + [cls]
        key = None
        bound = 1
        for dig, size in zip(digits, sizes):
            bound *= size
            dt = np.uint16 if bound <= 1 << 16 else np.int32 if bound < 1 << 31 else np.intp
            if key is None:
                key = ws(f"key_{np.dtype(dt).name}", n, dt)
                key[:] = dig
                continue
            if key.dtype != dt:
                wider = ws(f"key_{np.dtype(dt).name}", n, dt)
                wider[:] = key
                key = wider
            np.multiply(key, size, out=key, casting="unsafe")
            np.add(key, dig, out=key, casting="unsafe")
        if key.dtype != np.intp:               # bincount wants intp (it would convert anyway)
            wide = ws("key_intp", n, np.intp)
            wide[:] = key
            key = wide
        total = int(np.prod(sizes))
        sig = tuple((dims[i][0], dims[i][2], dims[i][3]) for i in g)
        out.append((sig, np.bincount(key, minlength=total), np.bincount(key, weights=weights, minlength=total)))
    return out


def _marginals(sig: _Sig, counts: np.ndarray, sums: np.ndarray,
               ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
    """Per dimension of a joint histogram: (name, count, S⁺, S⁻, keys or None) per digit."""
    shape = [size for _, size, _ in sig] + [3]
    c = counts.reshape(shape)
    sm = sums.reshape(shape)
    ca, sp, sn = c[..., 0] + c[..., 1], sm[..., 0], sm[..., 1]
    out = []
    for j, (name, size, lo) in enumerate(sig):
        axes = tuple(a for a in range(len(sig)) if a != j)
        out.append((name, ca.sum(axis=axes), sp.sum(axis=axes), sn.sum(axis=axes),
                    None if lo is None else lo + np.arange(size)))
    return out


class _Buckets:
    """count / Σ|Δ| / ΣΔ per bucket key, keys either a fixed range or arbitrary ints (turn, lag)."""

    def __init__(self, labels: list[str] | None = None) -> None:
        self.labels = labels
        self.fixed = np.zeros((3, len(labels)), dtype=np.float64) if labels is not None else None
        self.keyed: dict[int, np.ndarray] = {}

    def add_sums(self, count: np.ndarray, s_pos: np.ndarray, s_neg: np.ndarray,
                 keys: np.ndarray | None = None) -> None:
        """Per-digit count and sums of the positive / negative Δ (ΣΔ = S⁺ + S⁻, Σ|Δ| = S⁺ − S⁻);
        ``keys`` names each digit of a keyed breakdown."""
        if self.fixed is not None:
            self.fixed += np.stack([count, s_pos - s_neg, s_pos + s_neg])
            return
        for i in np.flatnonzero(count):
            acc = self.keyed.setdefault(int(keys[i]), np.zeros(3))
            acc += (count[i], s_pos[i] - s_neg[i], s_pos[i] + s_neg[i])

    def merge(self, other: "_Buckets") -> None:
        if self.fixed is not None:
            self.fixed += other.fixed
        for key, v in other.keyed.items():
            self.keyed.setdefault(key, np.zeros(3))[:] += v

    def rows(self, total_abs: float) -> list[dict[str, Any]]:
        if self.fixed is not None:
            items = [(lab, self.fixed[:, i]) for i, lab in enumerate(self.labels)]
        else:
            items = [(key, self.keyed[key]) for key in sorted(self.keyed)]
        out = []
        for key, (c, sa, sd) in items:
            out.append({"bucket": key, "count": int(c),
                        "mean_abs": sa / c if c else math.nan,
                        "mean": sd / c if c else math.nan,
                        "abs_share": sa / total_abs if total_abs > 0 else math.nan})
        return out

