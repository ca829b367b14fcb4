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
    per-layer Σ |A ∩ B| over valid rows. |A ∩ B| = Σ_i [a_i ∈ B] takes k² comparisons; the arrays
    are first transposed to [k, L, T] so that every comparison and count runs over one contiguous
    row (reductions over a short trailing axis of [T, L, k] are ~10× slower in numpy). Assumes the
    k experts of a row are distinct, which top-k guarantees. (The whole-step analysis counts the
    same in its compiled pass, ``kernels.breakdown_block``.)"""
    t, nl, k = rollout.shape
    r = np.ascontiguousarray(rollout.transpose(2, 1, 0))
    s = np.ascontiguousarray(train.transpose(2, 1, 0))
    valid = np.ones(t, dtype=bool) if valid is None else valid
    agree = None
    hits = np.zeros(nl, dtype=np.int64)
    for i in range(k):
        found = r[i] == s[0]
        for j in range(1, k):
            found |= r[i] == s[j]
        hits += [np.count_nonzero(found[layer] & valid) for layer in range(nl)]
        agree = found if agree is None else (agree & found)
    layer_agree = np.array([np.count_nonzero(agree[layer] & valid) for layer in range(nl)], dtype=np.int64)
    return agree, layer_agree, hits


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
    starts = np.zeros(i + 1 - a, dtype=bool)
    starts[0] = a == s0
    rows_valid = np.ones(i + 1 - a, dtype=bool) if valid is None else np.asarray(valid[a:i + 1]) != 0
    return int(routing_classes(np.array([i - a]), starts, agree.all(axis=0), rows_valid)[0])
