"""HDF5's Fletcher-32 checksum, compiled, and a chunk reader that verifies it itself.

The token columns `axrl-debug mismatch` scans are stored raw (chunked, fletcher32-checksummed;
see writer.py). Reading them through HDF5's filter pipeline costs ~0.5 ns per byte in the filter
alone — a third of the analysis. `read_checksummed` reads the stored chunks as they are
(`read_direct_chunk`, straight into the caller's buffer) and verifies each chunk's trailer with
`fletcher32` below: the same checksum, bit for bit, computed with block sums that vectorise.
A chunk whose checksum does not match raises `ChecksumError`, as HDF5's filter would fail.

Imports numba: used lazily by the reader's buffered (analysis) path only.
"""

from __future__ import annotations

import sys

import h5py
import numpy as np
from numba import njit

# HDF5 reduces its two 32-bit sums every 360 16-bit words: the most that cannot overflow sum2.
_BLOCK_WORDS = 360


class ChecksumError(ValueError):
    """A chunk's stored Fletcher-32 does not match its data."""


# weight of word j in a block's sum2: n − j, as the tail of 360, 359, …, 1
_WEIGHTS = (_BLOCK_WORDS - np.arange(_BLOCK_WORDS)).astype(np.uint32)


@njit(cache=True, nogil=True)
def _block_sums(words, weights):  # pragma: no cover - compiled
    """(Σw, Σ weights·w) of one block of big-endian 16-bit words (read little-endian), in 32 bits:
    exact, as Σw < 360·2¹⁶ and Σ(n − j)·w < 2³², and a loop LLVM vectorises."""
    a = np.uint32(0)
    b = np.uint32(0)
    for j in range(words.shape[0]):
        x = np.uint32(words[j])
        w = ((x & np.uint32(0xFF)) << np.uint32(8)) | (x >> np.uint32(8))
        a += w
        b += weights[j] * w
    return a, b


@njit(cache=True, nogil=True)
def _fletcher32_words(words, tail, has_tail, weights):  # pragma: no cover - compiled
    """H5_checksum_fletcher32 over big-endian 16-bit words and an optional odd last byte. Within a
    block of n words, sum1 grows by Σw and sum2 by n·sum1 + Σ (n − j)·w_j — the same integers as
    HDF5's word-by-word loop, without its serial chain."""
    s1 = np.uint64(0)
    s2 = np.uint64(0)
    nw = words.shape[0]
    full = weights.shape[0]
    i = 0
    while i < nw:
        n = min(full, nw - i)
        a, b = _block_sums(words[i:i + n], weights[full - n:])
        s2 += np.uint64(n) * s1 + np.uint64(b)
        s1 += np.uint64(a)
        s1 = (s1 & np.uint64(0xFFFF)) + (s1 >> np.uint64(16))
        s2 = (s2 & np.uint64(0xFFFF)) + (s2 >> np.uint64(16))
        i += n
    if has_tail:
        s1 += np.uint64(tail) << np.uint64(8)
        s2 += s1
        s1 = (s1 & np.uint64(0xFFFF)) + (s1 >> np.uint64(16))
        s2 = (s2 & np.uint64(0xFFFF)) + (s2 >> np.uint64(16))
    s1 = (s1 & np.uint64(0xFFFF)) + (s1 >> np.uint64(16))
    s2 = (s2 & np.uint64(0xFFFF)) + (s2 >> np.uint64(16))
    return np.uint32((s2 << np.uint64(16)) | s1)


def fletcher32(data: np.ndarray) -> int:
    """HDF5's Fletcher-32 of a byte array (``H5_checksum_fletcher32``)."""
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    even = data.size - data.size % 2
    tail = int(data[-1]) if data.size % 2 else 0
    return int(_fletcher32_words(data[:even].view(np.uint16), tail, data.size % 2 == 1, _WEIGHTS))


def _byteswap32(v: int) -> int:
    return int.from_bytes(v.to_bytes(4, "little"), "big")


def checksummed_raw(ds: h5py.Dataset) -> bool:
    """Whether ``ds`` is stored as ``read_checksummed`` reads it: chunked along rows only, with
    fletcher32 as its only filter, a numeric little-endian dtype, on a little-endian machine."""
    if sys.byteorder != "little" or ds.chunks is None or not ds.shape or ds.dtype.kind not in "biuf":
        return False
    if ds.dtype.byteorder == ">" or tuple(ds.chunks[1:]) != tuple(ds.shape[1:]):
        return False
    plist = ds.id.get_create_plist()
    return plist.get_nfilters() == 1 and plist.get_filter(0)[0] == h5py.h5z.FILTER_FLETCHER32


def padded_bytes(ds: h5py.Dataset) -> int:
    """Bytes ``read_checksummed`` needs for ``ds``: whole chunks (edge chunks are stored whole)
    plus the last chunk's 4-byte checksum trailer."""
    chunk_rows = ds.chunks[0]
    nchunks = -(-ds.shape[0] // chunk_rows)
    return nchunks * chunk_rows * _row_bytes(ds) + 4


def _row_bytes(ds: h5py.Dataset) -> int:
    return ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))


def read_checksummed(ds: h5py.Dataset, raw: np.ndarray, first: int = 0, last: int | None = None) -> np.ndarray:
    """Read ``ds`` (see ``checksummed_raw``) into the uint8 buffer ``raw`` (at least
    ``padded_bytes(ds)`` bytes) and return the data as an array of ``ds``'s shape and dtype, a view
    of ``raw``. Each chunk is read with its trailer and verified before the next one overwrites it.
    ``first`` / ``last``: only chunks ``first:last`` (default: all), whose rows come back from row
    ``first · chunks[0]`` on (``raw`` then needs room for those chunks and a trailer).

    Raises ``ChecksumError`` naming the chunk whose stored Fletcher-32 disagrees with its data;
    HDF5's own errors (a missing chunk, …) propagate."""
    rows, chunk_rows = ds.shape[0], ds.chunks[0]
    chunk_bytes = chunk_rows * _row_bytes(ds)
    zeros = (0,) * (len(ds.shape) - 1)
    last = -(-rows // chunk_rows) if last is None else last
    for c in range(first, last):
        at = (c - first) * chunk_bytes
        mask, _ = ds.id.read_direct_chunk((c * chunk_rows, *zeros), out=raw[at:at + chunk_bytes + 4])
        if mask:
            raise ChecksumError(f"chunk {c}: filter mask {mask} (checksum not applied)")
        stored = int(raw[at + chunk_bytes:at + chunk_bytes + 4].view("<u4")[0])
        got = fletcher32(raw[at:at + chunk_bytes])
        if stored != got and stored != _byteswap32(got):   # HDF5 accepts either byte order too
            raise ChecksumError(f"chunk {c} (rows from {c * chunk_rows}): Fletcher-32 mismatch")
    n = min(rows, last * chunk_rows) - first * chunk_rows
    return raw[:n * _row_bytes(ds)].view(ds.dtype).reshape((n,) + ds.shape[1:])


def read_rows_checksummed(ds: h5py.Dataset, start: int, stop: int, raw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``start:stop`` of ``ds`` (see ``checksummed_raw``) through ``read_checksummed`` of the
    chunks covering them: (the rows, a view of the buffer; the buffer, ``raw`` or a larger one)."""
    chunk_rows = ds.chunks[0]
    first, last = start // chunk_rows, max(-(-stop // chunk_rows), start // chunk_rows + 1)
    need = (last - first) * chunk_rows * _row_bytes(ds) + 4
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1 or raw.size < need:
        raw = np.empty(need + need // 4, dtype=np.uint8)      # room to grow
    rows = read_checksummed(ds, raw, first, last)
    return rows[start - first * chunk_rows:stop - first * chunk_rows], raw
