"""One step file, read lazily and safely: `StepFile` gives numpy arrays on request and attrs as a
dict (packed routing decoded, shard rows joined); `read_step` loads a whole file into a dict.
Nothing here unpickles: HDF5 through h5py only. `axrl.trace.reader` reads a run's steps with it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterable

import h5py
import numpy as np

from . import routing_codec
from . import schema as S
from .schema import CorruptStepError, SchemaVersionError, TraceError
from .shards import shard_files
from .writer import StepRecord

_READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError, TypeError)


def _checksum() -> Any:
    """The compiled checksum reader (imports numba: only the buffered analysis path uses it)."""
    from axrl.trace import checksum
    return checksum


def _py(value: Any) -> Any:
    """h5py attribute value -> plain python (str for strings, int/float/bool for scalars)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
        return [_py(v) for v in value.tolist()]
    return value


def _check_version(version: Any, where: str) -> int:
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise SchemaVersionError(f"{where}: schema_version {version!r} is not an integer")
    version = int(version)
    if version < 1 or version > S.SCHEMA_VERSION:
        raise SchemaVersionError(f"{where}: unknown schema_version {version} "
                                 f"(this axrl reads versions 1..{S.SCHEMA_VERSION}; upgrade axrl)")
    return version


class StepFile:
    """One step file, opened read-only. Use as a context manager or call ``close()``.

    ``sf["/tokens/ids"]`` (leading '/' optional) returns a numpy array; string datasets come back as
    object arrays of ``str`` (scalar string datasets as ``str``). Raises ``CorruptStepError`` if the
    file cannot be opened or lacks its required structure, ``SchemaVersionError`` for an unknown
    schema version.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._f = h5py.File(self.path, "r")
        except FileNotFoundError:
            raise
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.path}: cannot open as HDF5 ({e})") from None
        try:
            self.attrs: dict[str, Any] = {k: _py(v) for k, v in self._f.attrs.items()}
            if S.ATTR_SCHEMA_VERSION not in self.attrs:
                raise CorruptStepError(f"{self.path}: not an AxRL step file (no '{S.ATTR_SCHEMA_VERSION}' attr)")
            self.schema_version = _check_version(self.attrs[S.ATTR_SCHEMA_VERSION], str(self.path))
            for req in ("/samples/offsets", "/tokens/ids"):
                if req not in self._f:
                    raise CorruptStepError(f"{self.path}: missing required dataset {req}")
            self.shards = shard_files(self.path, self.attrs)   # a sharded step's (shards.py); all present
        except TraceError:
            self._f.close()
            raise
        except _READ_ERRORS as e:
            self._f.close()
            raise CorruptStepError(f"{self.path}: unreadable metadata ({e})") from None

    # ---- context / lifetime
    def __enter__(self) -> "StepFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._f.id.valid:
            self._f.close()

    def __repr__(self) -> str:
        return f"StepFile({str(self.path)!r}, step={self.step})"

    # ---- metadata
    @property
    def step(self) -> int:
        return int(self.attrs.get(S.ATTR_STEP, -1))

    @property
    def policy_version(self) -> int:
        return int(self.attrs.get(S.ATTR_POLICY_VERSION, -1))

    @property
    def wall_times(self) -> dict[str, float]:
        n = len(S.WALL_TIME_PREFIX)
        return {k[n:]: float(v) for k, v in self.attrs.items() if k.startswith(S.WALL_TIME_PREFIX)}

    @property
    def num_samples(self) -> int:
        return int(self._f["/samples/offsets"].shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._f["/tokens/ids"].shape[0])

    def keys(self) -> list[str]:
        """Absolute paths of every dataset in the file, sorted (walks every object header)."""
        out: list[str] = []

        def visit(name: bytes, info: Any) -> None:
            if info.type == h5py.h5o.TYPE_DATASET and name != b".":
                out.append("/" + name.decode("utf-8"))

        # the low-level walk: no Python Dataset/Group object per visited object (~6x faster)
        h5py.h5o.visit(self._f.id, visit, info=True)
        return sorted(routing_codec.raw_names(out, self._routing_attrs))

    def group_attrs(self, group: str) -> dict[str, Any]:
        return {k: _py(v) for k, v in self._f[group].attrs.items()} if group in self._f else {}

    def _dataset(self, name: str) -> h5py.Dataset | None:
        """The dataset at ``name`` or None (one lookup; a group there is not a dataset)."""
        try:
            obj = self._f[name]
        except (KeyError, ValueError):
            return None
        return obj if isinstance(obj, h5py.Dataset) else None

    def __contains__(self, name: str) -> bool:
        return self._dataset(name) is not None or self._packed_routing(name) is not None

    # packed routing (trace.routing_encoding: packed; routing_codec.py) reads as the raw arrays
    _routing_attrs = functools.cached_property(lambda self: self.group_attrs(S.G_ROUTING))

    def _packed_routing(self, name: str) -> str | None:
        return routing_codec.packed_name(self._f, self._routing_attrs, name) if "routing" in name else None

    def _decode_routing(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return routing_codec.read_range(self._f, self._routing_attrs, name, start, stop)
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.path}: cannot read {name}[{start}:{stop}] ({e})") from None

    # ---- data
    def __getitem__(self, name: str) -> Any:
        ds = self._dataset(name)
        if ds is None:
            if (packed := self._packed_routing(name)) is not None:
                return self._decode_routing(packed, 0, self.num_tokens)
            raise KeyError(f"{self.path}: no dataset {name!r}")
        return self._read(name, ds)

    def _read(self, name: str, ds: h5py.Dataset, buffers: dict[str, np.ndarray] | None = None,
              fast_checksums: bool = False) -> Any:
        try:
            dtype = ds.dtype
            if h5py.check_string_dtype(dtype) is not None:
                value = ds.asstr()[()]
                return value if isinstance(value, str) else np.asarray(value, dtype=object)
            shape = ds.shape
            if buffers is None or not shape or dtype.kind not in "biuf":
                return ds[()]
            if fast_checksums and shape[0] and _checksum().checksummed_raw(ds):
                # the analysed columns: read the stored chunks and verify their Fletcher-32 here,
                # at a third of the cost of HDF5's filter (axrl/trace/checksum.py)
                need = _checksum().padded_bytes(ds)
                raw = buffers.get(name)
                if raw is None or raw.dtype != np.uint8 or raw.ndim != 1 or raw.size < need:
                    raw = buffers[name] = np.empty(need + need // 4, dtype=np.uint8)   # room to grow
                return _checksum().read_checksummed(ds, raw)
            buf = buffers.get(name)
            if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
                buf = np.empty((shape[0] + shape[0] // 4,) + shape[1:], dtype=dtype)   # room to grow
                buffers[name] = buf
            out = buf[:shape[0]]
            if out.size:
                ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            return out
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.path}: cannot read {name} ({e})") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def read_slice(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a dataset, decompressing only the chunks that cover them
        (e.g. the context of one token without reading the whole ``/tokens/ids``)."""
        if name not in self:
            raise KeyError(f"{self.path}: no dataset {name!r}")
        if (packed := self._packed_routing(name)) is not None:
            return self._decode_routing(packed, *slice(int(start), int(stop)).indices(self.num_tokens)[:2])
        try:
            return self._f[name][int(start):int(stop)]
        except _READ_ERRORS as e:
            raise CorruptStepError(f"{self.path}: cannot read {name}[{start}:{stop}] ({e})") from None

    def read_columns(self, names: Iterable[str], *, optional: Iterable[str] = (),
                     buffers: dict[str, np.ndarray] | None = None, fast_checksums: bool = False) -> dict[str, Any]:
        """Several datasets at once, by absolute path: ``{path: array}``.

        Only the named datasets are read (the point of a lazy reader: an analysis that needs three
        token columns does not pay for the routing arrays). Names in ``optional`` that the file lacks
        are left out of the result; any other missing name raises ``KeyError``.

        ``buffers`` (a dict, initially empty, kept by the caller across calls): numeric arrays are
        read into per-name buffers that are reused by the next call with the same dict, and the
        result holds views of them — valid until that next call. With ``buffers``,
        ``fast_checksums=True`` reads raw fletcher32 columns chunk by chunk and verifies the
        checksums in compiled code (``checksum.py``: half the cost of HDF5's filter, but the first
        use in a process loads numba, ~0.4 s)."""
        opt = set(optional)
        out: dict[str, Any] = {}
        for name in dict.fromkeys([*names, *opt]):
            ds = self._dataset(name)
            if ds is not None:
                out[name] = self._read(name, ds, buffers, fast_checksums)
            elif self._packed_routing(name) is not None:
                out[name] = self[name]
            elif name not in opt:
                raise KeyError(f"{self.path}: no dataset {name!r}")
        return out

    def sample_slice(self, i: int) -> slice:
        """Token range of sample row ``i`` in every /tokens and /routing dataset."""
        off = self._f["/samples/offsets"]
        return slice(int(off[i]), int(off[i + 1]))

    def read_all(self) -> dict[str, Any]:
        """Every dataset by absolute path, plus ``'attrs'`` (root) and ``'group_attrs'``."""
        out: dict[str, Any] = {"attrs": dict(self.attrs), "group_attrs": {}}
        for g in (S.G_SAMPLES, S.G_TOKENS, S.G_ROUTING, S.G_TRAIN, S.G_UPDATES, S.G_MICRO_BATCHES):
            ga = self.group_attrs(g)
            if ga:
                out["group_attrs"][g] = ga
        for name in self.keys():
            out[name] = self[name]
        return out

    def to_record(self) -> StepRecord:
        """Rebuild the StepRecord this file was written from (arrays in their schema dtypes)."""
        kw: dict[str, Any] = {}
        for spec in S.DATASETS:
            if spec.path in self:
                kw[spec.field] = self[spec.path]
        kw["step"] = self.step
        kw["policy_version"] = self.policy_version
        kw["rng_digest"] = str(self.attrs.get(S.ATTR_RNG_DIGEST, ""))
        kw["wall_times"] = self.wall_times
        kw["attrs"] = {k: v for k, v in self.attrs.items()
                       if k not in S.RESERVED_ROOT_ATTRS and not k.startswith(S.WALL_TIME_PREFIX)}
        ne = self.group_attrs(S.G_ROUTING).get(S.ROUTING_ATTR_NUM_EXPERTS)
        kw["num_experts"] = None if ne is None else int(ne)

        def columns(group: str, skip: frozenset[str]) -> dict[str, Any]:
            if group not in self._f:
                return {}
            return {k: self[f"{group}/{k}"] for k, obj in self._f[group].items()
                    if isinstance(obj, h5py.Dataset) and k not in skip}

        kw["update_metrics"] = columns(S.G_UPDATES, S.UPDATE_RESERVED)
        kw["micro_batch_metrics"] = columns(S.G_MICRO_BATCHES, S.MICRO_BATCH_RESERVED)
        def known(group: str) -> frozenset[str]:
            return frozenset(p[len(group) + 1:] for p in S.DATASETS_BY_PATH if p.startswith(group + "/"))

        kw["extra_samples"] = columns(S.G_SAMPLES, known(S.G_SAMPLES))
        kw["extra_tokens"] = columns(S.G_TOKENS, known(S.G_TOKENS))
        return StepRecord(**kw)


def read_step(path: str | os.PathLike) -> dict[str, Any]:
    """Load a whole step file: ``{'attrs': {...}, 'group_attrs': {...}, '/tokens/ids': array, ...}``."""
    with StepFile(path) as sf:
        return sf.read_all()
