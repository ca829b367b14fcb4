"""A step's routing pair streamed as stored, a stored chunk at a time (``iter_chunks(stream_routing=True)``).

The analyses that only count what the routing rows say — the mismatch's agreement per layer and
per token — need neither the decoded [T, L, k] arrays nor a chunk's worth of them in memory (~100
bytes per token of a 48-layer top-8 step, twice). ``RoutingStream`` reads the stored datasets
through small windows of whole stored chunks (``_Rows``: each stored chunk read, and its checksum
verified, once, into a buffer reused for the whole run) and hands them over piece by piece
(``RoutingPiece``, about ``PIECE_BYTES`` of stored rollout routing each):

* raw routing: the rollout's and the trainer's [n, L, k] ids;
* packed routing (``routing_codec``): the packed rollout rows, the ``train_differs`` marks and the
  trainer's stored rows of the piece — found by a running count of the marks before it — undecoded,
  so that a consumer decodes only the (token, layer) rows the marks name (~10 % without R3, none
  with it); with their ``train_hits`` the agreement is counted without decoding any.
  ``RoutingPiece.arrays`` decodes a piece whole (``routing_codec``, the reference).

A piece's arrays are views of the reused windows: valid until the next piece is read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from . import routing_codec
from . import schema as S
from .step_file import _READ_ERRORS, StepFile, _checksum
from .schema import CorruptStepError

# Stored rollout routing per piece: a stored chunk of the writer's layout (≤ 1 MiB) stays in the
# core's cache between the read, the checksum and the consumer's pass.
PIECE_BYTES = 1 << 20


class _Rows:
    """Ascending row ranges of one stored dataset through a window of its whole stored chunks: a
    range inside the window is a view; one past it slides the window on, keeping the chunks it
    still covers, so each stored chunk is read once however the ranges fall (checksums verified
    in compiled code when ``fast`` and the dataset is stored raw, else through HDF5's filter)."""

    def __init__(self, sf: StepFile, name: str, buffers: dict[str, np.ndarray], fast: bool) -> None:
        ds = sf._f[name]
        self.sf, self.name, self.ds, self.buffers = sf, name, ds, buffers
        self.shape, self.dtype = ds.shape, ds.dtype
        self.row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))
        self.checked = fast and bool(ds.shape) and ds.shape[0] > 0 and _checksum().checksummed_raw(ds)
        self.chunk_rows = int(ds.chunks[0]) if ds.chunks else max(1, PIECE_BYTES // max(1, self.row_bytes))
        self.w0 = self.w1 = 0                       # rows [w0, w1) are in the window
        self._view = np.empty((0, *ds.shape[1:]), ds.dtype)

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` (a view of the window, valid until the next call)."""
        if b > self.shape[0]:
            raise CorruptStepError(f"{self.sf.path}: {self.name} has {self.shape[0]} rows, rows to {b} needed")
        if not (self.w0 <= a and b <= self.w1):
            self._slide(a, b)
        return self._view[a - self.w0:b - self.w0]

    def _slide(self, a: int, b: int) -> None:
        step, n = self.chunk_rows, self.shape[0]
        first, last = a // step, max(-(-b // step), a // step + 1)
        keep0 = max(first * step, self.w0)
        kept = self.w1 - keep0 if self.w0 <= first * step < self.w1 else 0   # whole chunks already read
        need = (last - first) * step * self.row_bytes + 4
        buf = self.buffers.get(self.name + "#window")
        if buf is None or buf.size < need:
            grown = np.empty(need + need // 4, np.uint8)
            if kept and buf is not None:
                grown[:kept * self.row_bytes] = buf[(keep0 - self.w0) * self.row_bytes:(self.w1 - self.w0) * self.row_bytes]
            buf = self.buffers[self.name + "#window"] = grown
        elif kept:
            at = (keep0 - self.w0) * self.row_bytes
            buf[:kept * self.row_bytes] = buf[at:at + kept * self.row_bytes]
        read0 = first * step + kept                  # chunk-aligned: kept rows are whole chunks
        stop = min(n, last * step)
        try:
            if read0 < stop:
                self._read(buf[kept * self.row_bytes:], read0, stop)
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.sf.path}: cannot read {self.name}[{read0}:{stop}] ({e})") from None
        self.w0, self.w1 = first * step, stop
        self._view = buf[:(stop - self.w0) * self.row_bytes].view(self.dtype).reshape((stop - self.w0, *self.shape[1:]))

    def _read(self, raw: np.ndarray, a: int, b: int) -> None:
        """Stored rows ``a:b`` (``a`` chunk-aligned) into the bytes ``raw``."""
        if self.checked:
            _checksum().read_checksummed(self.ds, raw, a // self.chunk_rows, -(-b // self.chunk_rows))
            return
        out = raw[:(b - a) * self.row_bytes].view(self.dtype).reshape((b - a, *self.shape[1:]))
        self.ds.read_direct(out, source_sel=np.s_[a:b], dest_sel=np.s_[0:b - a])


class RoutingPiece:
    """Rows ``start:stop`` (of the chunk) of the routing pair, as stored.

    Raw: ``rollout`` and ``train`` [n, L, k] ids, ``differs`` None. Packed: ``rollout`` uint8 [n, B]
    (``routing_codec.pack_ids``), ``differs`` uint8 [n, ⌈L/8⌉] (bit l of row t: the trainer's
    (t, l) differs), ``train`` uint8 [D, B_k] the trainer's packed rows of the D marked (t, l), in
    (token, layer) order, and ``hits`` uint8 [D] their |A ∩ B| with the rollout's rows (None in
    files written before ``/routing/train_hits``). ``rollout``, ``train`` and ``hits`` are read on
    first use: a consumer that finds no mark it needs (every trainer row the rollout's, as under
    R3), or counts agreement from ``hits``, never reads the routing rows themselves."""

    def __init__(self, start: int, stop: int, differs: np.ndarray | None, stream: "RoutingStream",
                 rows: tuple[int, int], train_rows: tuple[int, int]) -> None:
        self.start, self.stop, self.differs = start, stop, differs
        self.bits, self.layers, self.k, self.dtype = stream.bits, stream.layers, stream.k, stream.dtype
        self._stream, self._rows, self._train_rows = stream, rows, train_rows

    @functools.cached_property
    def rollout(self) -> np.ndarray:
        return self._stream.rollout.rows(*self._rows)

    @functools.cached_property
    def train(self) -> np.ndarray:
        return self._stream.train.rows(*self._train_rows)

    @functools.cached_property
    def hits(self) -> np.ndarray | None:
        return None if self._stream.hits is None else self._stream.hits.rows(*self._train_rows)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The piece's rollout and trainer [n, L, k] ids, decoded (``routing_codec``)."""
        if self.differs is None:
            return self.rollout, self.train
        rollout = routing_codec.unpack_ids(self.rollout, self.bits, (self.layers, self.k), self.dtype)
        train = routing_codec.decode_train(rollout, self.differs, self.train, self.bits)
        return rollout, train


@dataclass
class RoutingStream:
    """The routing pair of one open step, read in ascending token ranges (``RoutingRange``)."""

    sf: StepFile
    rollout: _Rows               # raw: /routing/rollout; packed: /routing/rollout_packed
    train: _Rows                 # raw: /routing/train; packed: /routing/train_rows
    differs: _Rows | None        # packed: /routing/train_differs
    bits: int
    layers: int
    k: int
    dtype: np.dtype
    hits: _Rows | None = None    # packed: /routing/train_hits, where the file has it
    next_token: int = 0          # packed: the token the running count is at …
    next_row: int = 0            # … and the trainer's stored rows before it

    @property
    def packed(self) -> bool:
        return self.differs is not None

    @classmethod
    def of(cls, sf: StepFile, buffers: dict[str, np.ndarray], fast: bool) -> "RoutingStream | None":
        """The stream of ``sf``'s routing, or None when it is not stored as [T, L, k] ids of every
        token (raw) or in ``routing_codec``'s layout (the caller then reads the arrays)."""
        t = sf.num_tokens
        try:
            if sf._packed_routing("/routing/rollout") is None:
                if sf._dataset("/routing/rollout") is None or sf._dataset("/routing/train") is None:
                    return None
                rr, rt = (_Rows(sf, n, buffers, fast) for n in ("/routing/rollout", "/routing/train"))
                if len(rr.shape) != 3 or rr.shape != rt.shape or rr.shape[0] != t:
                    return None
                return cls(sf, rr, rt, None, 0, rr.shape[1], rr.shape[2], rr.dtype)
            if sf._packed_routing("/routing/train") is None:
                return None
            attrs = sf._routing_attrs
            bits, layers, k = (int(attrs[a]) for a in (S.ROUTING_ATTR_BITS, S.ROUTING_ATTR_LAYERS, S.ROUTING_ATTR_K))
            dtype = S.routing_dtype(int(attrs[S.ROUTING_ATTR_NUM_EXPERTS]))
            names = (S.ROUTING_PACKED["/routing/rollout"], S.ROUTING_TRAIN_ROWS, S.ROUTING_TRAIN_DIFFERS)
            rp, rows, differs = (_Rows(sf, n, buffers, fast) for n in names)
            hits = _Rows(sf, S.ROUTING_TRAIN_HITS, buffers, fast) if S.ROUTING_TRAIN_HITS in sf._f else None
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{sf.path}: unreadable routing layout ({e})") from None
        expect = {rp.name: (t, _packed_width(layers * k, bits)), differs.name: (t, -(-layers // 8)),
                  rows.name: (rows.shape[0], _packed_width(k, bits))}
        for part in (rp, differs, rows):
            if part.shape != expect[part.name] or part.dtype != np.uint8:
                raise CorruptStepError(f"{sf.path}: {part.name} is {part.dtype} {part.shape}, expected uint8 "
                                       f"{expect[part.name]} for {t} tokens × {layers} layers × top-{k} at {bits} bits")
        if hits is not None and (hits.shape != (rows.shape[0],) or hits.dtype != np.uint8):
            raise CorruptStepError(f"{sf.path}: {hits.name} is {hits.dtype} {hits.shape}, expected uint8 "
                                   f"({rows.shape[0]},): one count per stored trainer routing row (/routing/train_rows)")
        return cls(sf, rp, rows, differs, bits, layers, k, dtype, hits)

    def pieces(self, a: int, b: int) -> Iterator[RoutingPiece]:
        """Tokens ``a:b`` in pieces along the stored rollout's chunks (``PIECE_BYTES`` or one chunk)."""
        step = self.rollout.chunk_rows * max(1, PIECE_BYTES // max(1, self.rollout.chunk_rows * self.rollout.row_bytes))
        p = a
        while p < b:
            q = min(b, (p // step + 1) * step)
            yield self._piece(a, p, q)
            p = q

    def _piece(self, a: int, p: int, q: int) -> RoutingPiece:
        if self.differs is None:
            return RoutingPiece(p - a, q - a, None, self, (p, q), (p, q))
        if p != self.next_token:        # not the next range in order: count the marks from the start
            self.next_row = _count_marks(self.differs, 0, p)
        differs = self.differs.rows(p, q)
        count = routing_codec.count_marks(differs)
        first = self.next_row
        self.next_token, self.next_row = q, self.next_row + count
        return RoutingPiece(p - a, q - a, differs, self, (p, q), (first, first + count))


@dataclass(frozen=True)
class RoutingRange:
    """The routing pair of one chunk (tokens ``token0:token1`` of the step), read on request."""

    stream: RoutingStream
    token0: int
    token1: int

    @property
    def packed(self) -> bool:
        return self.stream.packed

    @property
    def bits(self) -> int:
        return self.stream.bits

    @property
    def layers(self) -> int:
        return self.stream.layers

    @property
    def k(self) -> int:
        return self.stream.k

    def pieces(self) -> Iterator[RoutingPiece]:
        """The chunk's rows in pieces, in order (``RoutingPiece.start``/``stop``: from the chunk's start)."""
        return self.stream.pieces(self.token0, self.token1)


def _packed_width(ids: int, bits: int) -> int:
    """Bytes of a row of ``ids`` packed ids (``routing_codec.pack_ids``)."""
    return -(-ids // 8) * bits if bits <= 8 else -(-ids * bits // 8)


def _count_marks(differs: _Rows, a: int, b: int) -> int:
    """Marked (token, layer) rows of tokens ``a:b``, a window at a time."""
    total, step = 0, max(1, differs.chunk_rows)
    for p in range(a, b, step):
        total += routing_codec.count_marks(differs.rows(p, min(b, p + step)))
    return total
