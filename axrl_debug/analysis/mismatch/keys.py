"""Breakdown keys of each token, as numpy array arithmetic on a step's CSR columns: the sample
starts, the position inside the response segment and the digit (bucket index) of every breakdown.

These are the definitions: the numpy path (``tokens.step_tokens``, ``MismatchAccumulator.add``)
computes with them, and the compiled pass (``kernels.breakdown_block``) shares their tables
(``_POS_LUT``, ``_LOG_PROB_INNER_F32``, the entropy digits) and is tested against them."""

from __future__ import annotations

from typing import Any

import numpy as np

from .config import ENTROPY_EDGES, ENTROPY_LABELS, POSITION_EDGES, POSITION_LABELS, PROB_EDGES
from .scratch import _Scratch

# bucket on the logprob itself (no exp per token): bucket i ⇔ log(edge_i) <= lp < log(edge_i+1)
_LOG_PROB_INNER = np.log(np.asarray(PROB_EDGES[1:], dtype=np.float64))
_ENT_INNER = np.asarray(ENTROPY_EDGES[1:], dtype=np.float64)


def _ceil_f32(edge: float) -> np.float32:
    """The smallest float32 >= ``edge``: for a float32 x, ``x >= _ceil_f32(e)`` ⇔ ``float64(x) >= e``,
    so float32 columns are bucketed exactly without widening them to float64."""
    f = np.float32(edge)
    if float(f) < edge:
        f = np.nextafter(f, np.float32(np.inf))
    return f


_LOG_PROB_INNER_F32 = np.array([_ceil_f32(float(e)) for e in _LOG_PROB_INNER], dtype=np.float32)
_ENT_DROP = len(ENTROPY_LABELS)        # digit of a non-finite entropy (left out of that breakdown)
_ENT_LUT: np.ndarray | None = None     # float16 bit pattern -> entropy digit


def _sample_starts(off: np.ndarray, t: int, ws: _Scratch | None = None) -> np.ndarray:
    """bool [T]: token t is the first token of its sample."""
    starts = (ws or _Scratch())("starts", t + 1, bool)
    starts[:] = False
    starts[off[:-1]] = True                  # index t only for trailing empty samples
    return starts[:t]


def _segment_positions(gen: np.ndarray, starts: np.ndarray, turn: np.ndarray,
                       ws: _Scratch | None = None) -> np.ndarray:
    """Index of each token inside its response segment (a maximal run of loss-mask tokens of one
    sample and one turn); meaningful on loss-mask tokens only (others get any value)."""
    ws = ws or _Scratch()
    t = gen.shape[0]
    seg = ws("seg", t, bool)
    seg[:] = gen
    if t > 1:
        brk = np.logical_not(gen[:-1], out=ws("brk", t - 1, bool))
        brk |= starts[1:]
        brk |= np.not_equal(turn[1:], turn[:-1], out=ws("brk2", t - 1, bool))
        seg[1:] &= brk
    if t:
        seg[0] = True                  # tokens before the first segment: any value will do
    ss = np.flatnonzero(seg)
    # each token minus the start of its segment: one repeat, no prefix sum or binary search
    pos = np.repeat(ss, np.diff(ss, append=t))
    return np.subtract(ws.arange(t), pos, out=pos)


_POS_LUT = np.minimum(np.frexp(np.arange(POSITION_EDGES[-1] + 1, dtype=np.float64))[1],
                      len(POSITION_LABELS) - 1).astype(np.uint8)


def _position_digits(pos: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """0 → 0, 1 → 1, 2–3 → 2, 4–7 → 3, … (the bit length), capped at the last POSITION bucket: a
    table lookup whose index clipping does the capping (negative values → 0)."""
    ws = ws or _Scratch()
    out = ws("dig_pos", pos.shape[0], np.uint8)
    return np.take(_POS_LUT, pos.astype(np.intp, copy=False), out=out, mode="clip")


def _prob_digits(lp: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """rollout_prob bucket of each logprob (NaN → 0), comparing in log space."""
    ws = ws or _Scratch()
    n = lp.shape[0]
    out = ws("dig_prob", n, np.uint8)
    out[:] = 0
    if lp.dtype == np.float32:
        edges: Any = _LOG_PROB_INNER_F32
    else:
        lp = lp.astype(np.float64, copy=False)
        edges = _LOG_PROB_INNER
    ge = ws("ge", n, bool)
    for e in edges:
        out += np.greater_equal(lp, e, out=ge)
    return out


def _ent_lut() -> np.ndarray:
    global _ENT_LUT
    if _ENT_LUT is None:
        h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
        lut = np.zeros(h.shape, dtype=np.uint8)
        for e in _ENT_INNER:
            lut += h >= e
        lut[~np.isfinite(h)] = _ENT_DROP
        _ENT_LUT = lut
    return _ENT_LUT


def _entropy_digits(ent: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """entropy bucket of each value (as float32, like the recorded float16), ``_ENT_DROP`` where
    not finite. float16 columns go through a 65536-entry table of their bit patterns."""
    ws = ws or _Scratch()
    n = ent.shape[0]
    out = ws("dig_ent", n, np.uint8)
    if ent.dtype == np.float16:
        bits = ws("ent_bits", n, np.intp)
        bits[:] = ent.view(np.uint16)
        return np.take(_ent_lut(), bits, out=out, mode="clip")
    e32 = ent.astype(np.float32, copy=False)
    out[:] = 0
    for e in _ENT_INNER:
        out += e32 >= e
    out[~np.isfinite(e32)] = _ENT_DROP
    return out


def _int_digits(values: np.ndarray, idx: np.ndarray, span_max: int = 64, ws: _Scratch | None = None,
                name: str = "dig_int", reverse: bool = False,
                bounds: tuple[int, int] | None = None) -> tuple[np.ndarray, int, int]:
    """(digits in [0, size), lo, size) for an integer key column: digit = value − lo (``reverse``:
    hi − value), clipped to the range of the analysed tokens (rows ``idx``; or ``bounds`` when the
    caller knows it). The range of all rows is used when it is small (no gather); clipped values
    only ever belong to rows that are not analysed. The digits keep the column's dtype (signed,
    ≥ 32 bits for wide ranges)."""
    ws = ws or _Scratch()
    lo, hi = bounds if bounds is not None else (int(values.min()), int(values.max()))
    if bounds is None and hi - lo + 1 > span_max:
        sel = np.take(values, idx, out=ws(name + "_sel", idx.size, values.dtype), mode="clip")
        lo, hi = (int(sel.min()), int(sel.max())) if sel.size else (0, 0)
    dt = values.dtype if values.dtype.kind == "i" and np.iinfo(values.dtype).max >= hi - lo else np.int64
    out = ws(name, values.shape[0], dt)
    if reverse:
        np.subtract(hi, values, out=out, casting="unsafe")
    else:
        np.subtract(values, lo, out=out, casting="unsafe")
    np.clip(out, 0, hi - lo, out=out)
    return out, lo, hi - lo + 1

