"""Write one training step to ``trace/step_XXXXXX.h5``, crash-safely.

``StepRecord`` (`axrl.trace.step_record`) holds everything a step file contains (numpy arrays / python scalars; ragged per-sample
data as CSR offsets + flat token arrays). ``write_step`` validates it, writes ``step_XXXXXX.h5.tmp``,
flushes and fsyncs it, renames it to the final name with ``os.replace`` and fsyncs the directory, so
a final ``step_*.h5`` name only ever refers to a complete file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from . import routing_codec
from . import schema as S
from .kill_points import kill_point
from .prepare import _Prepared, prepare
from .step_record import StepRecord

__all__ = ["DEFAULT_COMPRESSION", "RAW_DATASETS", "StepRecord", "atomic_h5", "fsync_dir", "write_step"]

# Token-sized datasets (/tokens/*, /routing/*) are chunked and checksummed (fletcher32, so a damaged
# chunk raises on read instead of returning garbage). The per-token columns that `axrl-debug` reads
# for every token of a run (mismatch, summary, the TUI's step table) are stored raw: reading them
# back costs a copy plus the checksum, where byte shuffle + gzip-1 cost ~6x more (~140 vs ~23 ns per
# generated token for what `mismatch` reads; docs/trace-format.md "Cost"). The other token datasets
# (ids, advantage, ref_logprob, is_weight, loss_rule, extra columns) are byte-shuffled and compressed with
# DEFAULT_COMPRESSION (gzip level 1, built into every HDF5 library: h5dump, HDFView, Julia, C).
# So are the packed routing datasets (trace.routing_encoding: packed, routing_codec.py): chosen to
# make the trace small, and a trained model's routing repeats (a group's samples share their
# prompt, often their answer): gzip stores the quickstart's at ~0.1× its per-layer entropy
# (bench/trace_scale.py), uniform routing at ~1×.
DEFAULT_COMPRESSION: str | None = "gzip"
RAW_DATASETS = frozenset({
    "/tokens/loss_mask", "/tokens/rollout_logprob", "/tokens/old_logprob", "/tokens/turn",
    "/tokens/policy_version", "/tokens/entropy", "/tokens/behaviour_train_logprob",
    "/routing/rollout", "/routing/train", "/routing/rollout_valid",
    S.ROUTING_TRAIN_HITS,   # what the mismatch analysis reads of packed routing (~1 byte per 10 rows)
})
_CHUNK_BYTES = 1 << 20  # maximum chunk size of raw token datasets (read whole, in few calls)
# Compressed ones use smaller chunks: a chunk is decompressed whole even to read one row, and those
# datasets are the ones read a few rows at a time (the context of a token, one sample's ids).
_COMPRESSED_CHUNK_BYTES = 1 << 16


def _chunk_rows(rows: int, row_bytes: int, target: int = _CHUNK_BYTES) -> int:
    """Rows per chunk: at most ``target`` bytes, and as even as possible — an uncompressed chunk is
    stored whole, so a last chunk that is mostly padding would be stored as padding."""
    most = max(1, min(rows, target // max(1, row_bytes)))
    chunks = -(-rows // most)
    return -(-rows // chunks)


# ============================================================================ writing
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_h5(f: h5py.File, p: _Prepared, compression: str | None, checksum: bool = True,
              raw: frozenset[str] | set[str] = RAW_DATASETS) -> None:
    str_dt = h5py.string_dtype("utf-8")
    for path, value in p.datasets.items():
        if isinstance(value, str):
            f.create_dataset(path, data=value, dtype=str_dt)
            continue
        if value.dtype == object:
            f.create_dataset(path, shape=value.shape, dtype=str_dt, data=value if value.size else None)
            continue
        kw: dict[str, Any] = {}
        compress = compression if path not in raw else None
        if (compress or checksum) and value.size and path.startswith(S.TOKEN_GROUPS):
            row_bytes = value.itemsize * int(np.prod(value.shape[1:], dtype=np.int64))
            target = _COMPRESSED_CHUNK_BYTES if compress else _CHUNK_BYTES
            kw = dict(chunks=(_chunk_rows(value.shape[0], row_bytes, target),) + value.shape[1:],
                      fletcher32=checksum)
            if compress:
                kw.update(compression=compression, shuffle=True)
                if compression == "gzip":
                    kw["compression_opts"] = 1
        f.create_dataset(path, data=value, **kw)
    for name, attrs in p.group_attrs.items():
        g = f.require_group(name)
        for k, v in attrs.items():
            g.attrs[k] = v
    for k, v in p.root_attrs.items():
        f.attrs[k] = v


def _pack_routing(p: _Prepared) -> None:
    """Replace the raw routing datasets of ``p`` by their packed encoding (routing_codec.py)."""
    rollout = p.datasets.pop("/routing/rollout", None)
    if rollout is None:
        return
    attrs = p.group_attrs.setdefault(S.G_ROUTING, {})
    bits = routing_codec.bits_for(int(attrs[S.ROUTING_ATTR_NUM_EXPERTS]))
    _, layers, k = rollout.shape
    attrs.update({S.ROUTING_ATTR_ENCODING: routing_codec.ENCODING, S.ROUTING_ATTR_BITS: bits,
                  S.ROUTING_ATTR_LAYERS: layers, S.ROUTING_ATTR_K: k})
    compiled = _compiled_packing(rollout, bits)
    p.datasets[S.ROUTING_PACKED["/routing/rollout"]] = _pack(rollout, bits, compiled)
    train = p.datasets.pop("/routing/train", None)
    if train is not None:
        p.datasets[S.ROUTING_TRAIN_DIFFERS], p.datasets[S.ROUTING_TRAIN_ROWS], p.datasets[S.ROUTING_TRAIN_HITS] = \
            _encode_train(train, rollout, bits, compiled)


# Routing rows (token × layer) above which the compiled packing (routing_kernels) pays for loading
# numba (~0.45 s): numpy's `pack_ids` costs ~1 µs per (token, layer) row (eight whole-array shift
# passes over a uint64 copy), the compiled pass ~30 ns. On the 1 M-token step of
# bench/trace_scale.py numpy's pack + encode_train were 97 s of a 138 s write; the write is now
# 53 s, most of it the gzip of `rollout_packed` (docs/trace-format.md). The bytes are the same
# (tests/test_routing_codec.py).
_COMPILED_MIN_ROWS = 1 << 20


def _compiled_packing(rollout: np.ndarray, bits: int) -> bool:
    """Whether to pack ``rollout`` [T, L, k] with the compiled kernels: ids of at most 8 bits in
    an unsigned integer array, and numba already loaded or enough rows to pay for loading it."""
    import sys

    rows = rollout.shape[0] * rollout.shape[1]
    return bits <= 8 and rollout.ndim == 3 and rollout.dtype.kind == "u" and \
        (rows >= _COMPILED_MIN_ROWS or "numba" in sys.modules)


def _pack(ids: np.ndarray, bits: int, compiled: bool) -> np.ndarray:
    """``routing_codec.pack_ids`` of ``ids`` [T, ...], compiled when ``compiled``."""
    if not compiled:
        return routing_codec.pack_ids(ids, bits)
    from . import routing_kernels

    rows = np.ascontiguousarray(ids.reshape(ids.shape[0], int(np.prod(ids.shape[1:], dtype=np.int64))))
    out = np.empty((rows.shape[0], -(-rows.shape[1] // 8) * bits), np.uint8)
    routing_kernels.pack_rows(rows, bits, out)
    return out


def _encode_train(train: np.ndarray, rollout: np.ndarray, bits: int,
                  compiled: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``routing_codec.encode_train``, compiled when ``compiled`` (and the two arrays match)."""
    if not compiled or train.shape != rollout.shape or train.dtype != rollout.dtype:
        return routing_codec.encode_train(train, rollout, bits)
    from . import routing_kernels

    t, layers, _ = train.shape
    train, rollout = np.ascontiguousarray(train), np.ascontiguousarray(rollout)
    differs = np.zeros((t, -(-layers // 8)), np.uint8)
    hits = np.empty(t * layers, np.uint8)
    d = routing_kernels.diff_rows(train, rollout, differs, hits)
    mask = np.unpackbits(differs, axis=1, count=layers, bitorder="little").view(bool)
    return differs, _pack(train[mask], bits, True), hits[:d].copy()


def write_step(trace_dir: str | os.PathLike, record: StepRecord, *, overwrite: bool = False,
               compression: str | None = DEFAULT_COMPRESSION, checksum: bool = True,
               raw: frozenset[str] | set[str] = RAW_DATASETS, routing_encoding: str = "raw") -> Path:
    """Validate ``record`` and write ``trace_dir/step_{step:06d}.h5`` crash-safely; return its path.

    ``trace_dir`` is the run's ``trace/`` directory (created if missing). Raises
    ``TraceValidationError`` naming the bad field before touching the disk, and ``FileExistsError``
    if the step file exists unless ``overwrite``. Token-sized datasets are chunked (≤ 1 MiB) and,
    with ``checksum``, fletcher32-checksummed; those not in ``raw`` (dataset paths; default
    ``RAW_DATASETS``, the columns the analyses read per token) are also byte-shuffled and
    compressed with ``compression`` ('gzip' (level 1), 'lzf' or None). ``raw=frozenset()``
    compresses every token dataset; ``compression=None, checksum=False`` stores them contiguous.
    ``routing_encoding="packed"`` stores the routing bit-packed, the trainer's as its difference
    from the rollout's (routing_codec.py; read back as the same arrays).
    """
    if routing_encoding not in ("raw", "packed"):
        raise ValueError(f"trace.routing_encoding must be 'raw' or 'packed', got {routing_encoding!r}")
    prepared = prepare(record)
    if routing_encoding == "packed":
        _pack_routing(prepared)
    trace_dir = Path(trace_dir)
    if (trace_dir / S.MANIFEST_FILE).exists():
        raise ValueError(f"{trace_dir} is a run directory; pass its '{S.TRACE_DIR}/' subdirectory")
    trace_dir.mkdir(parents=True, exist_ok=True)
    final = trace_dir / S.step_file_name(record.step)
    if final.exists() and not overwrite:
        raise FileExistsError(f"step file already exists: {final} (pass overwrite=True, or truncate the run)")
    return atomic_h5(final, lambda f: _write_h5(f, prepared, compression, checksum, raw))


def atomic_h5(final: Path, fill: Callable[[h5py.File], None]) -> Path:
    """Write an HDF5 file with ``fill`` as ``final`` + '.tmp', fsync it, rename it to ``final`` and
    fsync the directory: ``final`` only ever names a complete file (a crash leaves the tmp)."""
    tmp = final.with_name(final.name + S.TMP_SUFFIX)
    try:
        with h5py.File(tmp, "w") as f:
            fill(f)
            f.flush()
        _fsync_path(tmp)
        kill_point(f"written:{final.name}")     # tests of crash recovery (AXRL_KILL_AT)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_dir(final.parent)
    kill_point(f"renamed:{final.name}")
    return final

