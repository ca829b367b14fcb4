"""Exact p50 / p99 of |Δ| without sorting every value: a histogram of the top 16 bits of each
|Δ| (an increasing function of a non-negative float) says which bins hold the needed order
statistics; only the values in those bins are partitioned. The result is ``np.percentile``'s
(linear interpolation) bit for bit."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .scratch import _Scratch

_HIST_SIZE = 1 << 16


def _top_bits(a: np.ndarray) -> np.ndarray:
    """The top 16 bits of each non-negative float: an increasing function of its value."""
    if a.dtype == np.float32:
        return a.view(np.uint32) >> np.uint32(16)
    return (a.astype(np.float64, copy=False).view(np.uint64) >> np.uint64(48)).view(np.int64)


def _bin_edges(b: int, dtype: Any) -> tuple[Any, Any]:
    """The smallest value of top-16-bit bin ``b`` and of the next one (None past the last)."""
    if np.dtype(dtype) == np.float32:
        ut, ft, shift = np.uint32, np.float32, 16
    else:
        ut, ft, shift = np.uint64, np.float64, 48
    lo = np.array([b << shift], dtype=ut).view(ft)[0]
    hi = np.array([(b + 1) << shift], dtype=ut).view(ft)[0] if b + 1 < _HIST_SIZE else None
    return lo, (None if hi is None or np.isnan(hi) else hi)      # the +inf bin: everything from lo


def _abs_hist(a: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    if a.dtype == np.float32 and ws is not None:     # shift straight into bincount's intp input
        bits = np.right_shift(a.view(np.uint32), np.uint32(16), out=ws("hist_bits", a.size, np.intp))
        return np.bincount(bits, minlength=_HIST_SIZE)
    return np.bincount(_top_bits(a), minlength=_HIST_SIZE)


def _percentile_ranks(n: int, qs: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's linear percentile: the ranks of the order statistics it interpolates between and
    the weight (``numpy.lib._function_base_impl._quantile``: index −1, the maximum, past the end)."""
    q = np.true_divide(np.asarray(qs, dtype=np.float64), 100)
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    above = virtual >= n - 1
    prev_i = np.where(above, n - 1, prev).astype(np.int64)
    next_i = np.where(above, n - 1, prev + 1).astype(np.int64)
    return prev_i, next_i, virtual - np.where(above, -1.0, prev)


def _percentile_bins(hist: np.ndarray, qs: tuple[float, ...] = (50.0, 99.0)) -> list[int]:
    """The histogram bins that hold the order statistics of the percentiles ``qs``."""
    n = int(hist.sum())
    if n == 0:
        return []
    prev_i, next_i, _ = _percentile_ranks(n, qs)
    cum = np.cumsum(hist)
    ranks = sorted(set(prev_i.tolist()) | set(next_i.tolist()))
    return sorted({int(b) for b in np.searchsorted(cum, ranks, side="right")})


def _values_in_bins(parts: list[np.ndarray], bins: list[int]) -> list[np.ndarray]:
    """The values of ``parts`` that fall in each of ``bins`` (one array per bin, in ``bins`` order).
    A bin's values lie between its first bit pattern and the next bin's (bit order is value order
    for non-negative floats): two comparisons, no integer view of every value."""
    out = []
    for b in bins:
        chunks = []
        for p in parts:
            lo, hi = _bin_edges(b, p.dtype)
            chunks.append(p[(p >= lo) & (p < hi)] if hi is not None else p[p >= lo])
        out.append(np.concatenate(chunks) if chunks else np.zeros(0))
    return out


def _exact_percentiles(parts: list[np.ndarray], hist: np.ndarray | None = None,
                       qs: tuple[float, ...] = (50.0, 99.0),
                       in_bins: dict[int, list[np.ndarray]] | None = None) -> tuple[float, ...]:
    """``np.percentile(np.concatenate(parts), qs)`` (linear interpolation, numpy's default), bit
    for bit, for non-negative floats of one dtype — without concatenating or partitioning them all.

    ``hist`` (``_abs_hist`` summed over the parts) says which top-16-bit bin holds each needed order
    statistic; only the values of those bins are gathered and partitioned. The interpolation is
    numpy's own arithmetic (``numpy.lib._function_base_impl._lerp``). ``in_bins`` adds values held
    elsewhere (by worker processes): counted in ``hist`` and given only for ``_percentile_bins``."""
    n = int(hist.sum()) if hist is not None else sum(int(p.size) for p in parts)
    if n == 0:
        return tuple(math.nan for _ in qs)
    if n <= _HIST_SIZE and not in_bins:   # small: a partition is cheaper than a 65536-bin histogram
        return tuple(float(v) for v in np.percentile(np.concatenate(parts), list(qs)))
    if hist is None:
        hist = sum(_abs_hist(p) for p in parts)
    prev_i, next_i, gamma = _percentile_ranks(n, qs)
    cum = np.cumsum(hist)
    by_bin: dict[int, list[int]] = {}
    for rank in sorted(set(prev_i.tolist()) | set(next_i.tolist())):
        by_bin.setdefault(int(np.searchsorted(cum, rank, side="right")), []).append(rank)
    value: dict[int, Any] = {}
    dtype = parts[0].dtype if parts else next(iter(in_bins.values()))[0].dtype
    local = dict(zip(by_bin, _values_in_bins(parts, list(by_bin))))
    for b, ranks in by_bin.items():
        below = int(cum[b - 1]) if b else 0
        sub = np.concatenate([local[b], *(in_bins or {}).get(b, [])])
        kth = [rank - below for rank in ranks]
        sub.partition(kth)
        for rank, k in zip(ranks, kth):
            value[rank] = sub[k]
    a = np.array([value[i] for i in prev_i.tolist()], dtype=dtype)
    b = np.array([value[i] for i in next_i.tolist()], dtype=dtype)
    with np.errstate(invalid="ignore"):      # inf − inf: NaN, as numpy's own percentile gives
        diff = b - a
        res = np.add(a, diff * gamma)
        np.subtract(b, diff * (1 - gamma), out=res, where=gamma >= 0.5, casting="unsafe", dtype=type(res.dtype))
    return tuple(float(v) for v in res)

