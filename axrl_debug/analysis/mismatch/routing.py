"""Routing agreement (MoE traces): rollout vs trainer expert sets per (token, layer), and the
routing class of each token — how the forward that *predicted* it routed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepRouting:
    layer_rows: int                   # valid rows compared
    layer_agree: np.ndarray           # int64 [L]: valid rows whose expert set agrees, per layer
    layer_hits: np.ndarray            # int64 [L]: Σ |A ∩ B| over valid rows, per layer
    topk: int                         # k (overlap = hits / (rows · k))
    token_class: np.ndarray           # int8 [n]: 0 agrees, 1 differs, 2 unknown (per analysed token)


def routing_agreement(rollout: np.ndarray, train: np.ndarray,
                      valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compare expert sets per (token, layer), order-insensitively and without sorting.

    Returns ``agree`` ([L, T] bool: the sets are equal), per-layer counts of agreeing valid rows and
    per-layer Σ |A ∩ B| over valid rows. Most rows are identical in order (all of them under R3),
    so each row's k ids are first compared as one machine word (``_rows_equal``): such a row agrees
    with |A ∩ B| = k. Only the rows that differ in order go through the set comparison, |A ∩ B| =
    Σ_i [a_i ∈ B] in k² comparisons over those rows. Assumes the k experts of a row are distinct,
    which top-k guarantees. (The whole-step analysis counts the same in its compiled pass,
    ``routing_kernels``.)"""
    t, nl, k = rollout.shape
    valid = np.ones(t, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    agree = _rows_equal(rollout, train)                                   # [T, L]
    hits = agree.astype(np.uint16) * np.uint16(k)
    rows_t, rows_l = np.nonzero(~agree)
    if rows_t.size:
        a, b = rollout[rows_t, rows_l], train[rows_t, rows_l]             # [D, k] each
        found = a == b[:, :1]
        for j in range(1, k):
            found |= a == b[:, j:j + 1]
        row_hits = np.count_nonzero(found, axis=1)
        agree[rows_t, rows_l] = row_hits == k
        hits[rows_t, rows_l] = row_hits
    layer_agree = np.count_nonzero(agree[valid], axis=0).astype(np.int64)
    layer_hits = hits[valid].sum(axis=0, dtype=np.int64)
    return agree.T, layer_agree, layer_hits


def _rows_equal(rollout: np.ndarray, train: np.ndarray) -> np.ndarray:
    """[T, L] bool: the (token, layer) rows hold the same ids in the same order — the k ids of a
    row compared as one unsigned word when they fill 1, 2, 4 or 8 bytes (a reduction over a
    short trailing axis is ~10× slower in numpy)."""
    width = rollout.shape[2] * rollout.dtype.itemsize
    if width in (1, 2, 4, 8) and rollout.dtype == train.dtype:
        word = np.dtype(f"<u{width}")
        r = np.ascontiguousarray(rollout).view(word)[..., 0]
        s = np.ascontiguousarray(train).view(word)[..., 0]
        return r == s
    return (rollout == train).all(axis=2)


def routing_classes(idx: np.ndarray, starts: np.ndarray, row_agree: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``routing_delta`` digit of tokens ``idx`` (int8): 0 when row t − 1 agrees in every layer,
    1 when a layer differs, 2 when unknown (t starts its sample, or row t − 1 is not valid).
    ``starts``: bool [T] first token of a sample; ``row_agree``: bool [T] every layer agrees;
    ``valid``: bool [T] the rollout row holds data."""
    has_prev = (idx > 0) & ~starts[idx]
    prev = np.where(has_prev, idx - 1, 0)
    known = has_prev & valid[prev]
    return np.where(known, np.where(row_agree[prev], 0, 1), 2).astype(np.int8)


def token_routing_class(i: int, s0: int, rollout: np.ndarray, train: np.ndarray, valid: np.ndarray | None) -> int:
    """``routing_classes`` of the one token ``i`` of the sample starting at ``s0``, from its rows
    i − 1 and i only (for the few worst tokens of the compiled path)."""
    a = max(i - 1, s0)
    agree, _, _ = routing_agreement(rollout[a:i + 1], train[a:i + 1])
    return _class_of(i, s0, a, agree.all(axis=0), valid)


def row_class(i: int, s0: int, row_agree: np.ndarray, valid: np.ndarray | None) -> int:
    """``token_routing_class`` from the block's ``row_agree`` (bool [T]: every layer of the row
    agrees, as ``routing_kernels.routing_rows`` / ``packed_routing_rows`` found it)."""
    a = max(i - 1, s0)
    return _class_of(i, s0, a, row_agree[a:i + 1], valid)


def _class_of(i: int, s0: int, a: int, rows_agree: np.ndarray, valid: np.ndarray | None) -> int:
    """``routing_classes`` of token ``i`` given whether rows ``a``…``i`` agree in every layer."""
    starts = np.zeros(i + 1 - a, dtype=bool)
    starts[0] = a == s0
    rows_valid = np.ones(i + 1 - a, dtype=bool) if valid is None else np.asarray(valid[a:i + 1]) != 0
    return int(routing_classes(np.array([i - a]), starts, rows_agree, rows_valid)[0])
