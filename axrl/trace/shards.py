"""Sharded steps: the rows of a step written by the processes that hold them, and a small index.

Under `runtime.executor: ray` with `trace.sharded` on, each train rank writes the routing rows of
its own samples (the bulk of a MoE step: 2·L·k bytes a token) into a shard file of the step,
``trace/step_XXXXXX.shards/<name>.h5``, and the learner writes the step file itself,
``trace/step_XXXXXX.h5``: everything else, plus an HDF5 virtual dataset per sharded column that
maps its row blocks onto the shard files. HDF5 resolves a virtual dataset's rows from the shards
on read (paths relative to the step file's directory, so a run directory can be moved), so
``StepFile`` and every tool built on it read a sharded step exactly as an unsharded one.

Crash safety: every shard is written to a temp file and renamed into place, and the step file
(the index) is written last, the same way; a step exists only once its index is renamed, so a
crash leaves at most shard files without an index, which ``RunDir.clean_tmp`` removes. The index
lists its shard files (root attr ``shard_files``); the reader refuses a step whose shards are
missing instead of reading the virtual datasets' fill value.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np

from . import schema as S
from .prepare import _Prepared, prepare
from .step_record import StepRecord
from .writer import DEFAULT_COMPRESSION, RAW_DATASETS, _pack_routing, _write_h5, atomic_h5

__all__ = ["SHARDED_PATHS", "ShardInfo", "remove_shards", "routing_rows", "shard_dir", "shard_files",
           "stray_shard_dirs", "write_shard", "write_sharded_step"]

#: The datasets a train rank writes for its rows (the step's per-token routing).
SHARDED_PATHS = ("/routing/rollout", "/routing/rollout_valid", "/routing/train")
ATTR_ROW_START, ATTR_ROW_STOP = "row_start", "row_stop"   # root attrs of a shard file: its rows of the step


@dataclass(frozen=True)
class ShardInfo:
    """One written shard file: where it is (relative to ``trace/``), which token rows of the step it
    holds, and the dtype and shape of each of its datasets (what the index's layout needs)."""

    file: str
    row_start: int
    row_stop: int
    datasets: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    routing_attrs: dict[str, Any] = field(default_factory=dict)   # /routing attrs (num_experts, packed encoding)


def shard_dir(trace_dir: str | os.PathLike, step: int) -> Path:
    """``trace/step_XXXXXX.shards``: the shard files of a sharded step."""
    return Path(trace_dir) / S.SHARDS_DIR_FORMAT.format(step=int(step))


def routing_rows(rollout: Any, train: Any, offsets: Any, num_experts: int,
                 encoding: str = "raw") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The /routing datasets of some samples' rows as a step file stores them, and the /routing
    attrs: expert ids ([rows, L, k]) in the schema's routing dtype, ``rollout_valid`` 0 on each
    sample's last token (it never went through the engine; its rollout row is stored as zeros);
    with ``encoding="packed"`` bit-packed, the trainer's as its difference (routing_codec.py: every
    packed dataset is in token order, so the shards' rows concatenate into the step's).
    ``offsets``: the samples' CSR offsets within these rows. A None routing is left out."""
    if encoding not in ("raw", "packed"):
        raise ValueError(f"trace.routing_encoding must be 'raw' or 'packed', got {encoding!r}")
    dtype = S.routing_dtype(int(num_experts))
    off = np.asarray(offsets, dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    for path, value in (("/routing/rollout", rollout), ("/routing/train", train)):
        if value is None:
            continue
        a = np.asarray(value)
        if a.size and (int(a.min()) < 0 or int(a.max()) >= num_experts):
            raise ValueError(f"{path}: expert ids outside [0, num_experts={num_experts})")
        out[path] = np.array(a, dtype=dtype, order="C")   # a copy: the zeroing below must not reach the caller
    if "/routing/rollout" in out:
        valid = np.ones(int(off[-1]), np.uint8)
        valid[off[1:][np.diff(off) > 0] - 1] = 0
        out["/routing/rollout"][valid == 0] = 0
        out["/routing/rollout_valid"] = valid
    prepared = _Prepared(out, {}, {S.G_ROUTING: {S.ROUTING_ATTR_NUM_EXPERTS: np.int64(num_experts)}})
    if encoding == "packed":
        _pack_routing(prepared)
    return prepared.datasets, prepared.group_attrs[S.G_ROUTING]


def write_shard(trace_dir: str | os.PathLike, step: int, name: str, row_start: int, row_stop: int,
                datasets: Mapping[str, np.ndarray], routing_attrs: Mapping[str, Any] | None = None, *,
                compression: str | None = DEFAULT_COMPRESSION, checksum: bool = True) -> ShardInfo:
    """Write ``datasets`` (paths of the step file; their rows are those of the step's token rows
    ``row_start:row_stop``, in order) as the shard ``name`` of ``step``, crash-safely; its
    ``ShardInfo``. Stored as the step file would store them (chunked, checksummed, compressed
    unless raw), with the ``/routing`` attrs ``routing_attrs``."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"shard name {name!r}: a plain file name stem")
    directory = shard_dir(trace_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    attrs = {S.ATTR_SCHEMA_VERSION: np.int64(S.SCHEMA_VERSION), S.ATTR_STEP: np.int64(step),
             ATTR_ROW_START: np.int64(row_start), ATTR_ROW_STOP: np.int64(row_stop)}
    prepared = _Prepared(dict(datasets), attrs, {S.G_ROUTING: dict(routing_attrs)} if routing_attrs else {})
    final = atomic_h5(directory / f"{name}.h5",
                      lambda f: _write_h5(f, prepared, compression, checksum, RAW_DATASETS))
    return ShardInfo(f"{directory.name}/{final.name}", int(row_start), int(row_stop),
                     {p: (a.dtype.str, tuple(a.shape)) for p, a in datasets.items()}, dict(routing_attrs or {}))


def _layouts(shards: list[ShardInfo], t: int) -> dict[str, h5py.VirtualLayout]:
    """One virtual layout per sharded dataset, its row blocks mapped onto the shards; refuses
    shards that do not cover rows 0..T exactly or disagree on a dataset's dtype or row shape."""
    shards = sorted((s for s in shards if s.row_stop > s.row_start), key=lambda s: s.row_start)
    at = 0
    for s in shards:
        if s.row_start != at:
            raise ValueError(f"shard {s.file} starts at row {s.row_start}, expected {at} (the shards must "
                             "cover the step's tokens once, in order)")
        at = s.row_stop
    if at != t:
        raise ValueError(f"the shards cover {at} token rows, the step has {t}")
    out: dict[str, h5py.VirtualLayout] = {}
    for path in dict.fromkeys(p for s in shards for p in s.datasets):
        held = [s for s in shards if path in s.datasets]
        kinds = {(s.datasets[path][0], tuple(s.datasets[path][1][1:])) for s in held}
        if len(held) != len(shards) or len(kinds) != 1:
            raise ValueError(f"{path}: not in every shard, or in different dtypes/shapes ({sorted(kinds)})")
        dtype, tail = kinds.pop()
        # each shard's rows follow the previous shard's: token rows, or (packed trainer routing)
        # the differing rows of its tokens, which are in token order too
        lengths = [int(s.datasets[path][1][0]) for s in held]
        layout = h5py.VirtualLayout(shape=(sum(lengths), *tail), dtype=np.dtype(dtype))
        at = 0
        for s, n in zip(held, lengths):
            if n:
                layout[at:at + n] = h5py.VirtualSource(s.file, path, shape=tuple(s.datasets[path][1]))
            at += n
        out[path] = layout
    return out


def write_sharded_step(trace_dir: str | os.PathLike, record: StepRecord, shards: list[ShardInfo], *,
                       overwrite: bool = False, compression: str | None = DEFAULT_COMPRESSION,
                       checksum: bool = True) -> Path:
    """Write the index of a sharded step: ``record`` (without the sharded columns) as
    ``trace_dir/step_XXXXXX.h5``, each dataset of ``shards`` a virtual dataset over their rows.
    Written last and renamed into place: the step is on disk from then on. With no shards this
    is ``write_step``'s file."""
    prepared = prepare(record)
    t = int(prepared.datasets["/samples/offsets"][-1])
    clash = sorted({p for s in shards for p in s.datasets} & set(prepared.datasets))
    if clash:
        raise ValueError(f"step {record.step}: {clash} both in the record and in its shards")
    layouts = _layouts(shards, t) if shards else {}
    routing = prepared.group_attrs.setdefault(S.G_ROUTING, {})
    for s in shards:
        for k, v in s.routing_attrs.items():
            if k in routing and routing[k] != v:
                raise ValueError(f"/routing attr {k}: shard {s.file} has {v!r}, the step {routing[k]!r}")
            routing[k] = v
    if not routing:
        del prepared.group_attrs[S.G_ROUTING]
    trace_dir = Path(trace_dir)
    final = trace_dir / S.step_file_name(record.step)
    if final.exists() and not overwrite:
        raise FileExistsError(f"step file already exists: {final} (pass overwrite=True, or truncate the run)")
    if shards:
        prepared.root_attrs[S.ATTR_SHARD_FILES] = np.asarray([s.file for s in shards], dtype=object)

    def fill(f: h5py.File) -> None:
        _write_h5(f, prepared, compression, checksum, RAW_DATASETS)
        for path, layout in layouts.items():
            f.create_virtual_dataset(path, layout, fillvalue=0)

    trace_dir.mkdir(parents=True, exist_ok=True)
    return atomic_h5(final, fill)


def shard_files(step_file: Path, attrs: Mapping[str, Any]) -> list[Path]:
    """The shard files a step file's root ``attrs`` list (none for an unsharded step). Raises
    ``CorruptStepError`` naming any that is missing: its rows would read as the virtual datasets'
    fill value."""
    names = attrs.get(S.ATTR_SHARD_FILES)
    if names is None:
        return []
    files = [step_file.parent / str(n) for n in ([names] if isinstance(names, str) else names)]
    missing = [str(p.relative_to(step_file.parent)) for p in files if not p.is_file()]
    if missing:
        step = S.parse_step_file_name(step_file.name)
        where = S.SHARDS_DIR_FORMAT.format(step=step) if step is not None else "its shard directory"
        raise S.CorruptStepError(f"{step_file}: shard file(s) {missing} missing (a sharded step is its step "
                                 f"file plus {where}/; copy or move them together)")
    return files


def remove_shards(trace_dir: Path, step: int) -> bool:
    """Delete the shard directory of ``step`` (if any); whether there was one."""
    d = shard_dir(trace_dir, step)
    if not d.is_dir():
        return False
    shutil.rmtree(d)
    return True


def stray_shard_dirs(trace_dir: Path) -> list[Path]:
    """Shard directories without their step file: a crash between a step's shards and its index."""
    if not trace_dir.is_dir():
        return []
    out = []
    for p in trace_dir.iterdir():
        m = S.SHARDS_DIR_RE.match(p.name)
        if m and p.is_dir() and not (trace_dir / S.step_file_name(int(m.group(1)))).exists():
            out.append(p)
    return sorted(out)


def check_shards(index: h5py.File, files: list[Path], step: int) -> None:
    """Raise ``CorruptStepError`` unless every virtual dataset of ``index`` (an open step file)
    finds its rows in a readable shard of ``step`` (``files``: the shard files it lists). HDF5
    reads a missing source as fill values; this is the check that it is not."""
    for path in files:
        try:
            with h5py.File(path, "r") as f:
                if int(f.attrs.get(S.ATTR_STEP, -1)) != step:
                    raise S.CorruptStepError(f"{path}: a shard of step {f.attrs.get(S.ATTR_STEP)}, "
                                             f"listed by step {step}")
        except (OSError, KeyError, ValueError) as e:
            raise S.CorruptStepError(f"{path}: unreadable shard of step {step} ({e})") from None
    base = Path(index.filename).parent
    virtual: list[h5py.Dataset] = []
    index.visititems(lambda _, obj: virtual.append(obj) if isinstance(obj, h5py.Dataset) and obj.is_virtual else None)
    for ds in virtual:
        for vs in ds.virtual_sources():
            src = base / vs.file_name
            try:
                with h5py.File(src, "r") as f:
                    got = f[vs.dset_name].shape
            except (OSError, KeyError, ValueError) as e:
                raise S.CorruptStepError(f"{src}: no readable {vs.dset_name} for step {step} ({e})") from None
            lo, hi = vs.vspace.get_select_bounds()   # the rows of the step this source fills
            want = (hi[0] - lo[0] + 1, *ds.shape[1:])
            if tuple(got) != tuple(want):
                raise S.CorruptStepError(f"{src}: {vs.dset_name} has shape {got}, the step file maps {want}")
