"""Reading one step in chunks of whole samples, so that an analysis holds one chunk at a time.

A production step (1 M tokens × 48 MoE layers × top-8: 768 MB of routing alone, 6 GB at 8 M
tokens) must not be read whole. ``iter_chunks`` cuts a step into runs of whole samples of about
``chunk_tokens`` tokens (``sample_chunks``) and yields each run's rows of the requested datasets:
per-token datasets (``/tokens/*``, ``/routing/*``) rows ``token0:token1``, per-sample datasets
(``/samples/*``) rows ``sample0:sample1`` — with ``/samples/offsets`` rebased so that the chunk
reads like a step of its own — and anything else (``/train/*``: a few values per update) whole.
Whole samples, because every per-token quantity of the analyses depends on its own sample only
(segment positions, the routing row before a token); so the memory bound is ``chunk_tokens``
or the longest sample, whichever is larger.

Packed routing (``routing_codec``) is decoded chunk by chunk, the rollout ids once for both
arrays, and the trainer's stored rows are found by a running count instead of a popcount of
everything before each chunk. Numeric chunks are read into per-name buffers reused from chunk to
chunk (``buffers``): the arrays of a chunk are only valid until the next one is read.

``stream_routing=True`` leaves the routing pair out of the chunk's arrays and hands over a
``RoutingRange`` instead (``routing_stream``): its rows as stored — raw ids, or the packed rollout,
the ``train_differs`` marks and the trainer's stored rows, undecoded — a stored chunk (~1 MiB) at a
time, for an analysis that needs only what the rows say (the mismatch's routing agreement) and would
otherwise decode, copy and hold ~100 bytes per token and layer of a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import h5py
import numpy as np

from . import routing_codec
from . import schema as S
from .columns import ColumnsByPath
from .step_file import _READ_ERRORS, StepFile, _checksum
from .routing_stream import RoutingRange, RoutingStream
from .schema import CorruptStepError

# Tokens per chunk: ~1 KB per token of a 48-layer top-8 MoE step (both routing arrays and the
# token columns) makes a chunk ~250 MB at most; the mismatch analysis folds a step in blocks of
# the same size, so a step read in chunks gives the very sums of a step read whole.
DEFAULT_CHUNK_TOKENS = 1 << 18

_ROUTING_PAIR = ("/routing/rollout", "/routing/train")


def sample_chunks(off: np.ndarray, t: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive runs of whole samples (sample index ranges) of about ``chunk_tokens`` tokens; a
    longer sample is a run of its own. One run for the whole step when it is at most 1.5 chunks."""
    n = off.size - 1
    if t <= chunk_tokens + chunk_tokens // 2 or n <= 1:
        return [(0, n)]
    cuts = np.unique(np.searchsorted(off, np.arange(chunk_tokens, t, chunk_tokens), side="right") - 1)
    cuts = cuts[(cuts > 0) & (cuts < n)].tolist()
    bounds = [0] + cuts + [n]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class StepChunk(ColumnsByPath):
    """Rows of one run of whole samples: samples ``sample0:sample1``, tokens ``token0:token1``.
    ``data`` maps dataset paths to arrays as ``StepFile.read_columns`` would for a step holding
    only these samples (``/samples/offsets`` starting at 0)."""

    index: int                  # 0, 1, … within the step
    count: int                  # chunks in the step
    sample0: int
    sample1: int
    token0: int
    token1: int
    data: dict[str, Any]
    routing: RoutingRange | None = None   # ``stream_routing``: the routing pair, as stored

    @property
    def num_tokens(self) -> int:
        return self.token1 - self.token0


def _per_token(name: str) -> bool:
    return name.startswith((S.G_TOKENS + "/", S.G_ROUTING + "/"))


def iter_chunks(sf: StepFile, names: Iterable[str], *, optional: Iterable[str] = (),
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, buffers: dict[str, np.ndarray] | None = None,
                fast_checksums: bool = False, stream_routing: bool = False) -> Iterator[StepChunk]:
    """The step of ``sf`` in runs of whole samples (``sample_chunks``), each with the rows of
    ``names`` (+ ``optional`` where present) it covers. A missing required name raises
    ``KeyError`` before anything is read; an unreadable chunk raises ``CorruptStepError``.

    ``buffers`` (a dict kept by the caller): numeric per-token chunks are read into reused
    per-name buffers, valid until the next chunk. ``fast_checksums``: raw fletcher32 columns are
    read as stored chunks and verified in compiled code (``checksum.read_rows_checksummed``; loads
    numba) instead of through HDF5's filter. ``stream_routing``: when both ``/routing/rollout`` and
    ``/routing/train`` are wanted (and stored as [T, L, k] ids or packed), each chunk's ``routing``
    streams them as stored (``RoutingRange``) and its ``data`` leaves them out."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    opt = set(optional)
    wanted = [n for n in dict.fromkeys([*names, *opt]) if n in sf]
    missing = [n for n in names if n not in wanted]
    if missing:
        raise KeyError(f"{sf.path}: no dataset {missing[0]!r}")
    off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
    t = int(off[-1]) if off.size else 0
    whole = {n: sf[n] for n in wanted if not _per_token(n) and not n.startswith(S.G_SAMPLES + "/")}
    per_sample = [n for n in wanted if n.startswith(S.G_SAMPLES + "/") and n != "/samples/offsets"]
    per_token = [n for n in wanted if _per_token(n)]
    bufs = {} if buffers is None else buffers
    stream = RoutingStream.of(sf, bufs, fast_checksums) if stream_routing and set(_ROUTING_PAIR) <= set(per_token) \
        else None
    if stream is not None:
        per_token = [n for n in per_token if n not in _ROUTING_PAIR]
    routing = _PackedRouting.of(sf, per_token, bufs, fast_checksums)
    runs = sample_chunks(off, t, chunk_tokens)
    for i, (s0, s1) in enumerate(runs):
        a, b = int(off[s0]), int(off[s1])
        data: dict[str, Any] = dict(whole)
        if "/samples/offsets" in wanted:
            data["/samples/offsets"] = off[s0:s1 + 1] - a
        for name in per_sample:
            data[name] = sf[name] if (s0, s1) == (0, off.size - 1) else sf.read_slice(name, s0, s1)
        decoded = routing.read(a, b) if routing is not None else {}
        for name in per_token:
            data[name] = decoded[name] if name in decoded else _read_rows(sf, name, a, b, bufs, fast_checksums)
        yield StepChunk(i, len(runs), s0, s1, a, b, data, None if stream is None else RoutingRange(stream, a, b))


def _read_rows(sf: StepFile, name: str, a: int, b: int, buffers: dict[str, np.ndarray], fast: bool) -> Any:
    """Rows ``a:b`` of a stored per-token dataset, into a reused buffer when numeric."""
    ds = sf._dataset(name)
    if ds is None:                                  # packed routing read alone
        return sf.read_slice(name, a, b)
    try:
        if h5py.check_string_dtype(ds.dtype) is not None or ds.dtype.kind not in "biuf":
            return sf.read_slice(name, a, b)
        if fast and b > a and ds.shape and _checksum().checksummed_raw(ds):
            rows, buffers[name] = _checksum().read_rows_checksummed(ds, a, b, buffers.get(name))
            return rows
        shape = (b - a,) + ds.shape[1:]
        buf = buffers.get(name)
        if buf is None or buf.dtype != ds.dtype or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            buf = buffers[name] = np.empty((shape[0] + shape[0] // 4,) + shape[1:], ds.dtype)   # room to grow
        out = buf[:shape[0]]
        if out.size:
            ds.read_direct(out, source_sel=np.s_[a:b], dest_sel=np.s_[0:b - a])
        return out
    except _READ_ERRORS as e:
        raise CorruptStepError(f"{sf.path}: cannot read {name}[{a}:{b}] ({e})") from None


@dataclass
class _PackedRouting:
    """Both packed routing arrays of a step, decoded range by range in step order: the rollout
    ids once for both, and the trainer's stored rows from a running count of those before."""

    sf: StepFile
    names: list[str]            # which of /routing/rollout, /routing/train are wanted
    buffers: dict[str, np.ndarray]   # the decoded arrays' reused buffers (by dataset name)
    fast: bool                  # read the stored datasets through ``checksum.read_rows_checksummed``
    next_token: int = 0         # the range the running count is at
    next_row: int = 0           # stored trainer rows before ``next_token``

    @classmethod
    def of(cls, sf: StepFile, per_token: list[str], buffers: dict[str, np.ndarray],
           fast: bool) -> "_PackedRouting | None":
        names = [n for n in _ROUTING_PAIR if n in per_token and sf._packed_routing(n) is not None]
        return cls(sf, names, buffers, fast) if names else None

    def _stored(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of the stored dataset ``name`` (its raw chunks verified compiled when fast)."""
        ds = self.sf._f[name]
        if self.fast and b > a and _checksum().checksummed_raw(ds):
            rows, self.buffers[name] = _checksum().read_rows_checksummed(ds, a, b, self.buffers.get(name))
            return rows
        return ds[a:b]

    def _out(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A reused buffer of ``shape`` for the decoded ``name`` (grown by a quarter when short)."""
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
            buf = self.buffers[name] = np.empty((shape[0] + shape[0] // 4,) + shape[1:], dtype)
        return buf[:shape[0]]

    def read(self, a: int, b: int) -> dict[str, np.ndarray]:
        f, attrs = self.sf._f, self.sf._routing_attrs
        try:
            bits = int(attrs[S.ROUTING_ATTR_BITS])
            shape = (int(attrs[S.ROUTING_ATTR_LAYERS]), int(attrs[S.ROUTING_ATTR_K]))
            dtype = S.routing_dtype(int(attrs[S.ROUTING_ATTR_NUM_EXPERTS]))
            rollout = _unpack(self._stored(S.ROUTING_PACKED["/routing/rollout"], a, b), bits, shape, dtype,
                              self._out("/routing/rollout", (b - a, *shape), dtype))
            out = {"/routing/rollout": rollout}
            if "/routing/train" in self.names:
                differs_ds = f[S.ROUTING_TRAIN_DIFFERS]
                if a != self.next_token:       # not the next range in order: count from the start
                    self.next_row = int(routing_codec.popcount_rows(differs_ds[:a]).sum()) if a else 0
                differs = self._stored(S.ROUTING_TRAIN_DIFFERS, a, b)
                count = int(routing_codec.popcount_rows(differs).sum())
                rows = self._stored(S.ROUTING_TRAIN_ROWS, self.next_row, self.next_row + count)
                out["/routing/train"] = _decode_train(rollout, differs, rows, bits,
                                                      self._out("/routing/train", rollout.shape, rollout.dtype))
                self.next_token, self.next_row = b, self.next_row + count
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.sf.path}: cannot read the packed routing [{a}:{b}] ({e})") from None
        return {n: out[n] for n in self.names}


# Below this many rows numpy's decoding beats loading numba (~0.45 s) for the compiled one.
_COMPILED_MIN_ROWS = 1 << 17


def _compiled(rows: int) -> bool:
    """Whether to decode ``rows`` rows with ``routing_kernels`` (numba already loaded, or worth it)."""
    import sys

    return rows >= _COMPILED_MIN_ROWS or "numba" in sys.modules


def _unpack(packed: np.ndarray, bits: int, shape: tuple[int, int], dtype: np.dtype, out: np.ndarray) -> np.ndarray:
    """``routing_codec.unpack_ids``, compiled for ids of at most 8 bits (``routing_kernels``) into
    ``out`` [t, *shape]."""
    if bits > 8 or not _compiled(packed.shape[0]) or packed.ndim != 2 or packed.shape[1] != -(-(shape[0] * shape[1]) // 8) * bits:
        return routing_codec.unpack_ids(packed, bits, shape, dtype)
    from . import routing_kernels

    routing_kernels.unpack_rows(packed, bits, out.reshape(packed.shape[0], shape[0] * shape[1]))
    return out


def _decode_train(rollout: np.ndarray, differs: np.ndarray, rows: np.ndarray, bits: int, out: np.ndarray) -> np.ndarray:
    """``routing_codec.decode_train``, compiled for ids of at most 8 bits (``routing_kernels``)
    into ``out`` (the shape of ``rollout``)."""
    k = rollout.shape[2]
    if bits > 8 or not _compiled(rollout.shape[0]) or rows.ndim != 2 or rows.shape[1] != -(-k // 8) * bits or \
            differs.shape[1] != -(-rollout.shape[1] // 8):
        return routing_codec.decode_train(rollout, differs, rows, bits)
    from . import routing_kernels

    used = routing_kernels.decode_train(rollout, differs, rows, bits, out)
    if used != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} stored trainer rows for {used} differing (token, layer) rows")
    return out
