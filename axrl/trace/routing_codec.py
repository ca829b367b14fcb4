"""Compact on-disk routing: rollout routing bit-packed, trainer routing as its difference.

``/routing/rollout`` and ``/routing/train`` are [T, L, k] expert ids, one byte (two above 256
experts) each: 16 bytes per token and layer at k = 8, most of a MoE step's trace. With
``trace.routing_encoding: packed`` the writer stores instead

* ``/routing/rollout_packed`` uint8 [T, ⌈L·k / 8⌉·b]: each token's L·k ids at b = ⌈log₂ E⌉ bits
  (`pack_ids`), one row per token (so a token range decodes on its own);
* ``/routing/train_differs`` uint8 [T, ⌈L / 8⌉]: bit l of token t set when the trainer routed
  (t, l) to another expert list than the engine (R3 makes them all equal);
* ``/routing/train_rows`` uint8 [D, ⌈k / 8⌉·b]: the trainer's ids of those D (token, layer) rows,
  packed the same way, in (token, layer) order;
* ``/routing/train_hits`` uint8 [D]: for each of those rows |A ∩ B|, how many of the rollout's k
  ids the trainer's row holds (k: the same set in another order) — the routing agreement,
  computed once at write time so that the analysis counts it from the marks and these bytes
  without decoding any routing row (files written before it lack it: the rows are decoded then);

and marks ``/routing`` with ``encoding = "packed-v1"`` and ``bits``, ``layers``, ``k``. The
reader (`StepFile`) decodes them back to the very arrays a raw file holds, so nothing above it
changes. The information floor: a top-8 set of 128 experts carries log₂ C(128, 8) ≈ 40.4 bits,
so no lossless encoding of uniform routing goes below ≈ 5 bytes per token and layer.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from . import schema as S

__all__ = ["ENCODING", "bits_for", "pack_ids", "unpack_ids", "encode_train", "decode_train", "popcount_rows",
           "count_marks", "packed_name", "raw_names", "read_range", "set_hits"]

ENCODING = "packed-v1"
_ROWS_PER_CHUNK = 1 << 15          # tokens packed at a time: bounds the bit-expanded temporary
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.int64)


def bits_for(num_experts: int) -> int:
    """Bits per expert id: ⌈log₂ E⌉ (at least 1)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return max(1, math.ceil(math.log2(num_experts)))


def pack_ids(ids: np.ndarray, bits: int) -> np.ndarray:
    """[T, ...] non-negative ids < 2**bits → uint8 [T, B] (n ids per row), row by row: each row a
    little-endian bit stream, id j at bits [j·b, (j+1)·b).

    For b ≤ 8 (E ≤ 256: every MoE model so far) eight ids are exactly b bytes: each group of eight
    (the row zero-padded to a multiple of eight) is shifted into one little-endian uint64 and its
    low b bytes kept, B = ⌈n / 8⌉·b. Wider ids are packed bit by bit, B = ⌈n·b / 8⌉."""
    rows = ids.reshape(ids.shape[0], int(np.prod(ids.shape[1:], dtype=np.int64)))
    n = rows.shape[1]
    if bits > 8:
        return _pack_bitwise(rows, bits)
    groups = -(-n // 8)
    out = np.empty((rows.shape[0], groups * bits), np.uint8)
    for a in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[a:a + _ROWS_PER_CHUNK]
        padded = np.zeros((chunk.shape[0], groups * 8), np.uint64)
        padded[:, :n] = chunk
        eights = padded.reshape(chunk.shape[0], groups, 8)
        words = eights[:, :, 0].copy()
        for j in range(1, 8):          # (a reduce over a length-8 axis is ~20x slower in numpy)
            words |= eights[:, :, j] << np.uint64(j * bits)
        octets = words.astype("<u8").view(np.uint8).reshape(chunk.shape[0], groups, 8)
        out[a:a + chunk.shape[0]] = octets[:, :, :bits].reshape(chunk.shape[0], groups * bits)
    return out


def unpack_ids(packed: np.ndarray, bits: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The inverse of `pack_ids`: uint8 [T, B] → ``dtype`` [T, *shape] (``shape``: ids per row)."""
    n = int(np.prod(shape, dtype=np.int64))
    if bits > 8:
        return _unpack_bitwise(packed, bits, n, dtype).reshape((packed.shape[0], *shape))
    groups = -(-n // 8)
    out = np.empty((packed.shape[0], groups * 8), dtype)
    mask = np.uint64((1 << bits) - 1)
    for a in range(0, packed.shape[0], _ROWS_PER_CHUNK):
        chunk = packed[a:a + _ROWS_PER_CHUNK]
        octets = np.zeros((chunk.shape[0], groups, 8), np.uint8)
        octets[:, :, :bits] = chunk.reshape(chunk.shape[0], groups, bits)
        words = octets.view("<u8")[:, :, 0]                          # [t, groups]
        ids = out[a:a + chunk.shape[0]].reshape(chunk.shape[0], groups, 8)
        for j in range(8):
            ids[:, :, j] = (words >> np.uint64(j * bits)) & mask
    return out[:, :n].reshape((packed.shape[0], *shape))


def _pack_bitwise(rows: np.ndarray, bits: int) -> np.ndarray:
    """`pack_ids` for ids wider than a byte (more than 256 experts), one bit plane at a time."""
    n = rows.shape[1]
    out = np.empty((rows.shape[0], -(-n * bits // 8)), np.uint8)
    shifts = np.arange(bits, dtype=np.uint32)
    for a in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[a:a + _ROWS_PER_CHUNK].astype(np.uint32)
        expanded = ((chunk[:, :, None] >> shifts) & 1).astype(np.uint8).reshape(chunk.shape[0], n * bits)
        out[a:a + chunk.shape[0]] = np.packbits(expanded, axis=1, bitorder="little")
    return out


def _unpack_bitwise(packed: np.ndarray, bits: int, n: int, dtype: np.dtype) -> np.ndarray:
    out = np.empty((packed.shape[0], n), dtype)
    weights = np.uint32(1) << np.arange(bits, dtype=np.uint32)
    for a in range(0, packed.shape[0], _ROWS_PER_CHUNK):
        chunk = packed[a:a + _ROWS_PER_CHUNK]
        expanded = np.unpackbits(chunk, axis=1, count=n * bits, bitorder="little").reshape(chunk.shape[0], n, bits)
        out[a:a + chunk.shape[0]] = expanded.astype(np.uint32) @ weights
    return out


def encode_train(train: np.ndarray, rollout: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trainer routing [T, L, k] as (differs uint8 [T, ⌈L/8⌉], packed rows of the differing (t, l),
    each of those rows' |A ∩ B| with the rollout's, uint8 [D])."""
    differs = (train != rollout).any(axis=2)
    rows = train[differs]                                   # [D, k], in (token, layer) order
    hits = set_hits(rollout[differs], rows)
    return np.packbits(differs, axis=1, bitorder="little"), pack_ids(rows, bits), hits


def set_hits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of ``a`` and ``b`` ([D, k] expert ids each): Σ_i [a_i ∈ b], as uint8 — |A ∩ B| for
    top-k rows (distinct ids), the count the mismatch analysis's routing agreement is made of."""
    if not a.shape[0]:
        return np.zeros(0, np.uint8)
    out = np.empty(a.shape[0], np.uint8)
    for s in range(0, a.shape[0], _ROWS_PER_CHUNK):        # bounds the [n, k] boolean temporary
        x, y = a[s:s + _ROWS_PER_CHUNK], b[s:s + _ROWS_PER_CHUNK]
        found = x == y[:, :1]
        for j in range(1, y.shape[1]):
            found |= x == y[:, j:j + 1]
        out[s:s + x.shape[0]] = np.count_nonzero(found, axis=1)
    return out


def popcount_rows(differs: np.ndarray) -> np.ndarray:
    """Differing (token, layer) rows per token of a `encode_train` mask: int64 [T]."""
    return _POPCOUNT[differs].sum(axis=1) if differs.size else np.zeros(differs.shape[0], np.int64)


def count_marks(differs: np.ndarray) -> int:
    """Differing (token, layer) rows of a token range of a `encode_train` mask (= ``popcount_rows(…).sum()``)."""
    if hasattr(np, "bitwise_count"):          # numpy >= 2: one pass, no int64 temporary
        return int(np.bitwise_count(differs).sum(dtype=np.int64))
    return int(popcount_rows(differs).sum())


def decode_train(rollout: np.ndarray, differs: np.ndarray, rows: np.ndarray, bits: int) -> np.ndarray:
    """Trainer routing of a token range: ``rollout`` [t, L, k] (the same range, decoded) with the
    ``rows`` (packed, the range's differing rows in order) put where ``differs`` says."""
    t, layers, k = rollout.shape
    mask = np.unpackbits(differs, axis=1, count=layers, bitorder="little").astype(bool)
    out = rollout.copy()
    if rows.shape[0]:
        out[mask] = unpack_ids(rows, bits, (k,), rollout.dtype)
    return out


def read_range(f: Mapping[str, Any], attrs: Mapping[str, Any], name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of the packed ``/routing/rollout`` or ``/routing/train`` of the open step
    file ``f`` (``attrs``: its ``/routing`` attrs), reading only the stored rows they need: the
    trainer's rows of a token range start after the popcount of the rows before it."""
    bits, shape = int(attrs[S.ROUTING_ATTR_BITS]), (int(attrs[S.ROUTING_ATTR_LAYERS]), int(attrs[S.ROUTING_ATTR_K]))
    dtype = S.routing_dtype(int(attrs[S.ROUTING_ATTR_NUM_EXPERTS]))
    rollout = unpack_ids(f[S.ROUTING_PACKED["/routing/rollout"]][start:stop], bits, shape, dtype)
    if name == "/routing/rollout":
        return rollout
    differs_ds = f[S.ROUTING_TRAIN_DIFFERS]
    first = int(popcount_rows(differs_ds[:start]).sum()) if start else 0
    differs = differs_ds[start:stop]
    rows = f[S.ROUTING_TRAIN_ROWS][first:first + int(popcount_rows(differs).sum())]
    return decode_train(rollout, differs, rows, bits)


def packed_name(f: Mapping[str, Any], attrs: Mapping[str, Any], name: str) -> str | None:
    """``/routing/rollout`` or ``/routing/train`` when ``name`` (leading '/' optional) is one of them
    and the open step file ``f`` stores it packed (``attrs``: its ``/routing`` attrs), else None."""
    name = "/" + name.lstrip("/")
    if name not in ("/routing/rollout", "/routing/train") or attrs.get(S.ROUTING_ATTR_ENCODING) != ENCODING:
        return None
    stored = S.ROUTING_PACKED["/routing/rollout"] if name == "/routing/rollout" else S.ROUTING_TRAIN_DIFFERS
    return name if stored in f else None


def raw_names(names: list[str], attrs: Mapping[str, Any]) -> list[str]:
    """A step file's dataset paths as a raw file would list them (packed routing datasets renamed)."""
    if attrs.get(S.ROUTING_ATTR_ENCODING) != ENCODING:
        return names
    stored = {S.ROUTING_PACKED["/routing/rollout"]: "/routing/rollout", S.ROUTING_TRAIN_DIFFERS: "/routing/train"}
    return [stored.get(n, n) for n in names if n not in (S.ROUTING_TRAIN_ROWS, S.ROUTING_TRAIN_HITS)]
