"""The compiled routing comparison of a block (``routing_kernels``):
on [T, L, k] arrays, or on a chunk's routing streamed as stored (``axrl.trace.routing_stream``) —
packed routing compared from its ``train_differs`` marks, decoding only the marked rows. Either
way the same figures: per layer, the valid rows whose expert sets agree and Σ |A ∩ B| over them,
and per row whether every layer agrees."""

from __future__ import annotations

from typing import Any

import numpy as np

from axrl.trace import CorruptStepError, routing_codec
from axrl.trace.routing_stream import RoutingRange

NO_COUNTS = np.zeros(0, np.int32)          # no per-row agreeing-layer counts wanted
_NO_WORDS = np.zeros((1, 1), np.uint64)


def _kernels() -> Any:
    """The compiled routing kernels (imports numba on first use)."""
    from . import routing_kernels
    return routing_kernels


def compare_rows(rr: np.ndarray, rt: np.ndarray, valid: np.ndarray, has_valid: bool,
                 row_agree: np.ndarray, layer_agree: np.ndarray, layer_hits: np.ndarray,
                 row_layers: np.ndarray) -> None:
    """``routing_kernels.routing_rows`` on a block's routing (rows as words where they fill 8 bytes, a
    bitset of the expert ids for the rows that differ in order): ``layer_agree`` / ``layer_hits``
    set to the block's valid rows that agree / Σ |A ∩ B|, per layer."""
    disagree, lost = np.zeros(rr.shape[1], np.int64), np.zeros(rr.shape[1], np.int64)
    _rows_pass(rr, rt, valid, has_valid, row_agree, disagree, lost, row_layers)
    _set_counts(_valid_rows(rr.shape[0], valid, has_valid), int(rr.shape[2]), disagree, lost, layer_agree, layer_hits)


def compare_stream(rng: RoutingRange, valid: np.ndarray, has_valid: bool, row_agree: np.ndarray,
                   layer_agree: np.ndarray, layer_hits: np.ndarray, row_layers: np.ndarray = NO_COUNTS) -> None:
    """``compare_rows`` on a chunk's routing read piece by piece as stored (``rng``): packed pieces
    with their stored agreement counts (``/routing/train_hits``) through
    ``routing_kernels.hits_routing_rows`` (no routing row read); older packed pieces of ids ≤ 8 bits through ``routing_kernels.packed_routing_rows`` (only the marked valid rows
    decoded; a piece without such marks, as under R3, does not even read its rollout rows), others decoded
    (``RoutingPiece.arrays``) through ``routing_kernels.routing_rows``. ``row_layers`` (int32 [T],
    when not empty): the agreeing layers of each valid row (an invalid row's is not compared). A
    packed piece whose marks disagree with its stored trainer rows raises ``CorruptStepError``."""
    layers, k = rng.layers, rng.k
    disagree, lost = np.zeros(layers, np.int64), np.zeros(layers, np.int64)
    ids, members = np.zeros(2 * k, np.int64), np.zeros(4, np.uint64)
    kern = _kernels()
    for p in rng.pieces():
        v = valid[p.start:p.stop] if has_valid else valid
        agree = row_agree[p.start:p.stop]
        counts = row_layers[p.start:p.stop] if row_layers.size else NO_COUNTS
        hits = p.hits if p.differs is not None else None
        if hits is not None:
            # the agreement stored at write time (/routing/train_hits): no routing row is read
            used = kern.hits_routing_rows(p.differs, hits, k, v, has_valid, agree, disagree, lost, counts)
            if used != hits.shape[0]:
                raise CorruptStepError(f"{rng.stream.sf.path}: {hits.shape[0]} stored routing agreement counts for "
                                       f"tokens {rng.token0 + p.start}:{rng.token0 + p.stop}, whose marks name "
                                       f"{'others' if used < 0 else used}")
        elif p.differs is not None and p.bits <= 8:
            # the rollout rows are read only when a valid row is marked (the comparison skips the
            # others): under R3 only the marks of the rows never fed to the model, if any
            marked = routing_codec.count_marks(p.differs[v != 0] if has_valid else p.differs)
            rollout = p.rollout if marked else np.empty((p.stop - p.start, 0), np.uint8)
            used = kern.packed_routing_rows(rollout, p.bits, p.differs, p.train, k, v, has_valid, agree,
                                            disagree, lost, ids, members, counts)
            if used != p.train.shape[0]:
                raise CorruptStepError(f"{rng.stream.sf.path}: {p.train.shape[0]} stored trainer routing rows for "
                                       f"tokens {rng.token0 + p.start}:{rng.token0 + p.stop}, whose marks name "
                                       f"{'others' if used < 0 else used}")
        else:
            rr, rt = p.arrays()
            _rows_pass(rr, rt, v, has_valid, agree, disagree, lost, counts)
    _set_counts(_valid_rows(row_agree.shape[0], valid, has_valid), k, disagree, lost, layer_agree, layer_hits)


def _rows_pass(rr: np.ndarray, rt: np.ndarray, valid: np.ndarray, has_valid: bool,
               row_agree: np.ndarray, disagree: np.ndarray, lost: np.ndarray, row_layers: np.ndarray) -> None:
    rw, tw = _row_words(rr), _row_words(rt)
    has_words = rw is not None and tw is not None
    small = rr.dtype in (np.uint8, np.uint16) and rt.dtype == rr.dtype
    members = np.zeros((int(np.iinfo(rr.dtype).max) + 1) // 64 if small else 0, np.uint64)   # a bit per id
    _kernels().routing_rows(rr, rt, rw if has_words else _NO_WORDS, tw if has_words else _NO_WORDS, has_words,
                      valid, has_valid, row_agree, disagree, lost, members, row_layers)


def _valid_rows(t: int, valid: np.ndarray, has_valid: bool) -> int:
    return int(np.count_nonzero(valid)) if has_valid else t


def _set_counts(rows: int, k: int, disagree: np.ndarray, lost: np.ndarray, layer_agree: np.ndarray,
                layer_hits: np.ndarray) -> None:
    """Per layer: agreeing rows = valid rows − those that differ; Σ |A ∩ B| = valid rows · k − Σ lost."""
    layer_agree[:] = rows - disagree
    layer_hits[:] = rows * k - lost


def _row_words(ids: np.ndarray) -> np.ndarray | None:
    """[T, L] uint64 view of [T, L, k] ids whose k ids fill exactly 8 bytes (top-8 of ≤ 256
    experts, top-4 of more): each (token, layer) row compared as one word. None otherwise."""
    if ids.ndim != 3 or ids.shape[2] * ids.dtype.itemsize != 8 or not ids.flags.c_contiguous:
        return None
    return ids.view(np.uint64)[..., 0]


def routing_arrays(rng: RoutingRange) -> dict[str, np.ndarray]:
    """The chunk's ``/routing/rollout`` and ``/routing/train`` as [T, L, k] arrays, decoded (for the
    numpy path, which compares arrays)."""
    parts = [tuple(np.array(x) for x in p.arrays()) for p in rng.pieces()]
    shape = (0, rng.layers, rng.k)
    return {name: np.concatenate([part[i] for part in parts]) if parts else np.zeros(shape, rng.stream.dtype)
            for i, name in enumerate(("/routing/rollout", "/routing/train"))}
