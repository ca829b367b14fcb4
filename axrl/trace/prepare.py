"""Validation of a `StepRecord` before anything touches the disk: `prepare` checks every field
against the schema (`axrl.trace.schema`) and converts it to its stored dtype, naming the first bad
field; `axrl.trace.writer` (and the shard writer) write what it returns.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import numpy as np

from . import schema as S
from .schema import TraceValidationError
from .step_record import StepRecord

__all__ = ["prepare"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


# ============================================================================ validation helpers
def _fail(name: str, msg: str) -> TraceValidationError:
    return TraceValidationError(f"StepRecord.{name}: {msg}")


def _as_int(name: str, value: Any, dtype: str | np.dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if value is None:
        raise _fail(name, "is required, got None")
    a = np.asarray(value)
    if a.size == 0:
        return a.astype(dt)
    if a.dtype.kind not in "iub":
        raise _fail(name, f"dtype {a.dtype} is not an integer type (expected {dt})")
    if a.dtype != dt and a.dtype.kind != "b":
        info = np.iinfo(dt)
        lo, hi = int(a.min()), int(a.max())
        if lo < info.min or hi > info.max:
            raise _fail(name, f"values [{lo}, {hi}] do not fit {dt}")
    return np.ascontiguousarray(a, dtype=dt)


def _as_float(name: str, value: Any, dtype: str | np.dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if value is None:
        raise _fail(name, "is required, got None")
    a = np.asarray(value)
    if a.size and a.dtype.kind not in "fiub":
        raise _fail(name, f"dtype {a.dtype} is not numeric (expected {dt})")
    return np.ascontiguousarray(a, dtype=dt)


def _as_str_array(name: str, value: Any) -> np.ndarray:
    if value is None:
        raise _fail(name, "is required, got None")
    if isinstance(value, (str, bytes)):
        raise _fail(name, "expected a sequence of strings, got a single string")
    items = list(np.asarray(value, dtype=object).ravel()) if isinstance(value, np.ndarray) else list(value)
    out = np.empty(len(items), dtype=object)
    for i, s in enumerate(items):
        if isinstance(s, bytes):
            try:
                s = s.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _fail(name, f"item {i} is not valid UTF-8: {e}") from None
        elif isinstance(s, np.str_):
            s = str(s)
        if not isinstance(s, str):
            raise _fail(name, f"item {i} is {type(s).__name__}, expected str")
        out[i] = s
    return out


def _as_str(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise _fail(name, f"expected str, got {type(value).__name__}")
    return value


def _check_shape(name: str, a: np.ndarray, shape: tuple[int, ...], dims: str) -> None:
    if a.shape != shape:
        raise _fail(name, f"shape {a.shape}, expected {shape} ({dims})")


def _check_offsets(name: str, off: np.ndarray, total: int | None, total_name: str) -> None:
    if off.ndim != 1 or off.size < 1:
        raise _fail(name, f"must be 1-D with at least one entry (CSR offsets), got shape {off.shape}")
    if off[0] != 0:
        raise _fail(name, f"must start at 0, got {off[0]}")
    if off.size > 1 and bool((np.diff(off) < 0).any()):
        raise _fail(name, "must be non-decreasing")
    if total is not None and off[-1] != total:
        raise _fail(name, f"last offset {off[-1]} != {total_name}={total}")


def _check_index(name: str, idx: np.ndarray, n: int) -> None:
    if idx.ndim != 1:
        raise _fail(name, f"must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise _fail(name, f"row indices must be in [0, N={n}), got [{idx.min()}, {idx.max()}]")


def _check_name(where: str, key: str) -> None:
    if not isinstance(key, str) or not _NAME_RE.match(key):
        raise _fail(where, f"invalid name {key!r} (letters, digits, '_', '.', '-')")


def _as_metric_column(where: str, key: str, value: Any, length: int, length_name: str,
                      required: Mapping[str, str]) -> np.ndarray:
    name = f"{where}[{key!r}]"
    if key in required:
        dt = np.dtype(required[key])
        a = _as_int(name, value, dt) if dt.kind in "iu" else _as_float(name, value, dt)
    else:
        a = np.asarray(value)
        if a.size == 0:
            a = a.astype(np.float64)
        elif a.dtype.kind == "f":
            a = a.astype(np.float64)
        elif a.dtype.kind in "iub":
            a = _as_int(name, a, np.int64)
        else:
            raise _fail(name, f"dtype {a.dtype} is not numeric")
    _check_shape(name, a, (length,), length_name)
    return np.ascontiguousarray(a)


def _as_extra(where: str, key: str, value: Any, length: int, length_name: str) -> np.ndarray:
    name = f"{where}[{key!r}]"
    a = np.asarray(value)
    if a.dtype.kind in "OUS":
        if a.ndim != 1:
            raise _fail(name, f"string columns must be 1-D, got shape {a.shape}")
        a = _as_str_array(name, value)
    elif a.dtype.kind not in "biuf":
        raise _fail(name, f"dtype {a.dtype} is not numeric or string")
    if a.ndim < 1 or a.shape[0] != length:
        raise _fail(name, f"shape {a.shape}, expected leading dimension {length_name}={length}")
    return np.ascontiguousarray(a)


def _as_attr(name: str, value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, (str, bytes)):
        return _as_str(name, value)
    a = np.asarray(value)
    if a.ndim == 1 and a.dtype.kind in "biuf":
        return a
    raise _fail(name, f"attribute values must be str/int/float/bool or 1-D numeric, got {type(value).__name__}")


# ============================================================================ prepare
@dataclass
class _Prepared:
    datasets: dict[str, Any]                     # path -> np.ndarray | str (scalar string)
    root_attrs: dict[str, Any]
    group_attrs: dict[str, dict[str, Any]]


def prepare(record: StepRecord) -> _Prepared:
    """Validate ``record`` and convert every field to its schema dtype. Raises TraceValidationError.

    Phase by phase, in file order (the first bad field found is the one reported): samples [N],
    tokens [T], routing, optimizer updates [U], micro-batches [M], pool, extra columns, root attrs.
    """
    r = record
    if not isinstance(r.step, (int, np.integer)) or int(r.step) < 0:
        raise _fail("step", f"must be an int >= 0, got {r.step!r}")
    if not isinstance(r.policy_version, (int, np.integer)):
        raise _fail("policy_version", f"must be an int, got {r.policy_version!r}")
    ds = _samples(r)
    off = ds["/samples/offsets"]
    n, t = off.size - 1, int(off[-1])
    ds.update(_tokens(r, t))
    routing, group_attrs = _routing(r, t)
    ds.update(routing)
    ds.update(_updates(r, n))
    u = ds["/train/updates/sample_offsets"].size - 1
    micro_batches, m = _micro_batches(r, n, u)
    ds.update(micro_batches)
    ds["/train/weights_fingerprint_before"] = _as_str("weights_fingerprint_before", r.weights_fingerprint_before)
    ds["/train/weights_fingerprint_after"] = _as_str("weights_fingerprint_after", r.weights_fingerprint_after)
    ds.update(_pool(r))
    ds.update(_extras(r, n, t))
    return _Prepared(ds, _root_attrs(r, n, t, u, m), group_attrs)


def _as_spec_dtype(spec: S.DatasetSpec, value: Any) -> np.ndarray:
    """``value`` as the dtype of the schema dataset ``spec`` (strings, integers range-checked, floats)."""
    if spec.dtype == S.STR:
        return _as_str_array(spec.field, value)
    if spec.np_dtype.kind in "iu":
        return _as_int(spec.field, value, spec.np_dtype)
    return _as_float(spec.field, value, spec.np_dtype)


def _samples(r: StepRecord) -> dict[str, Any]:
    """The /samples datasets: the CSR offsets, then one row per sample."""
    off = _as_int("sample_offsets", r.sample_offsets, np.int64)
    _check_offsets("sample_offsets", off, None, "T")
    n = off.size - 1
    ds: dict[str, Any] = {"/samples/offsets": off}
    lengths = np.diff(off)
    ds.update(_record_columns(r, "/samples/", n, "N = len(sample_offsets) - 1",
                              defaults={"error": [""] * n}, skip=("/samples/offsets",)))
    pl = ds["/samples/prompt_len"]
    if n and (bool((pl < 0).any()) or bool((pl > lengths).any())):
        i = int(np.nonzero((pl < 0) | (pl > lengths))[0][0])
        raise _fail("prompt_len", f"sample {i}: prompt_len {pl[i]} not in [0, {lengths[i]}] (its length)")
    return ds


def _record_columns(r: StepRecord, prefix: str, length: int, dims: str, *,
                    defaults: Mapping[str, Any] | None = None, skip: Collection[str] = ()) -> dict[str, Any]:
    """The schema's datasets under `prefix` from the record's fields, each `length` long; an
    optional field left None is not stored (unless `defaults` gives its value)."""
    ds: dict[str, Any] = {}
    for spec in S.DATASETS:
        if not spec.path.startswith(prefix) or spec.path in skip:
            continue
        value = getattr(r, spec.field)
        if value is None and defaults is not None:
            value = defaults.get(spec.field)
        if value is None and not spec.required:
            continue
        a = _as_spec_dtype(spec, value)
        _check_shape(spec.field, a, (length,), dims)
        ds[spec.path] = a
    return ds


def _tokens(r: StepRecord, t: int) -> dict[str, Any]:
    """The /tokens datasets, one entry per token of all samples (T = ``t``)."""
    ds = _record_columns(r, "/tokens/", t, "T = sample_offsets[-1]")
    lm = ds["/tokens/loss_mask"]
    if t and int(lm.max()) > 1:
        raise _fail("loss_mask", "values must be 0 or 1")
    return ds


def _routing(r: StepRecord, t: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The /routing datasets ([T, L, k] expert ids stored in the smallest dtype that holds
    ``num_experts``) and the group's attrs; none without routing or ``num_experts``."""
    ds: dict[str, Any] = {}
    group_attrs: dict[str, dict[str, Any]] = {}
    have_routing = r.routing_rollout is not None or r.routing_train is not None
    if r.routing_rollout_valid is not None and r.routing_rollout is None:
        raise _fail("routing_rollout_valid", "given without routing_rollout")
    if not have_routing:
        if r.num_experts is not None:
            group_attrs[S.G_ROUTING] = {S.ROUTING_ATTR_NUM_EXPERTS: np.int64(int(r.num_experts))}
        return ds, group_attrs
    if r.num_experts is None:
        raise _fail("num_experts", "is required when routing is recorded")
    ne = int(r.num_experts)
    try:
        rdt = S.routing_dtype(ne)
    except ValueError as e:
        raise _fail("num_experts", str(e)) from None
    group_attrs[S.G_ROUTING] = {S.ROUTING_ATTR_NUM_EXPERTS: np.int64(ne)}
    valid = None
    if r.routing_rollout_valid is not None:
        valid = _as_int("routing_rollout_valid", r.routing_rollout_valid, np.uint8)
        _check_shape("routing_rollout_valid", valid, (t,), "T")
        if t and int(valid.max()) > 1:
            raise _fail("routing_rollout_valid", "values must be 0 or 1")
        ds["/routing/rollout_valid"] = valid
    lk = None
    for fname, path in (("routing_rollout", "/routing/rollout"), ("routing_train", "/routing/train")):
        value = getattr(r, fname)
        if value is None:
            continue
        a = np.asarray(value)
        if a.ndim != 3 or a.shape[0] != t or a.shape[1] < 1 or a.shape[2] < 1:
            raise _fail(fname, f"shape {a.shape}, expected (T={t}, L, k) with L, k >= 1")
        if lk is not None and a.shape[1:] != lk:
            raise _fail(fname, f"shape {a.shape} disagrees with routing_rollout's (L, k) = {lk}")
        lk = a.shape[1:]
        if a.size and a.dtype.kind not in "iu":
            raise _fail(fname, f"dtype {a.dtype} is not an integer type")
        if fname == "routing_rollout" and valid is not None and t and not valid.all():
            a = a.copy()
            a[valid == 0] = 0  # rows never fed to the model are stored as zeros
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= ne:
                raise _fail(fname, f"expert ids [{lo}, {hi}] outside [0, num_experts={ne})")
        ds[path] = np.ascontiguousarray(a, dtype=rdt)
    return ds, group_attrs


def _updates(r: StepRecord, n: int) -> dict[str, Any]:
    """The optimizer updates: which samples each trained on, per-update metrics, per-tensor
    gradient norms and weight fingerprints."""
    uoff = _as_int("update_sample_offsets", r.update_sample_offsets, np.int64)
    us = _as_int("update_samples", r.update_samples, np.int64)
    _check_index("update_samples", us, n)
    _check_offsets("update_sample_offsets", uoff, us.size, "len(update_samples)")
    u = uoff.size - 1
    ds: dict[str, Any] = {"/train/update_samples": us, "/train/updates/sample_offsets": uoff}
    metrics = dict(r.update_metrics or {})
    if u > 0 or metrics:
        missing = [k for k in S.UPDATE_REQUIRED if k not in metrics]
        if missing:
            raise _fail("update_metrics", f"missing required column(s) {missing}")
    ds.update(_metric_columns("update_metrics", metrics, S.G_UPDATES, S.UPDATE_REQUIRED, S.UPDATE_RESERVED, u,
                              "U = len(update_sample_offsets) - 1"))
    if (r.param_names is None) != (r.param_grad_norm is None):
        raise _fail("param_grad_norm", "param_names and param_grad_norm go together")
    if r.param_names is not None:
        names = _as_str_array("param_names", r.param_names)
        norms = _as_float("param_grad_norm", r.param_grad_norm, np.float64)
        _check_shape("param_grad_norm", norms, (u, names.size), "[U, P = len(param_names)]")
        ds["/train/param_names"] = names
        ds["/train/param_grad_norm"] = norms
    if r.update_fingerprints is not None:
        fp = _as_str_array("update_fingerprints", r.update_fingerprints)
        _check_shape("update_fingerprints", fp, (u,), "U")
        ds["/train/updates/weights_fingerprint_after"] = fp
    return ds


def _metric_columns(where: str, metrics: dict[str, Any], group: str, required: Mapping[str, str],
                    reserved: Collection[str], length: int, length_name: str) -> dict[str, Any]:
    """One dataset per metric column under `group` (required ones present even when empty), each
    checked for its name and its length."""
    for k in required:
        metrics.setdefault(k, np.zeros(0))
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        _check_name(where, k)
        if k in reserved:
            raise _fail(where, f"column name {k!r} is reserved")
        out[f"{group}/{k}"] = _as_metric_column(where, k, v, length, length_name, required)
    return out


def _micro_batches(r: StepRecord, n: int, u: int) -> tuple[dict[str, Any], int]:
    """The micro-batches (which samples each held, per-micro-batch metrics) and their number M."""
    ds: dict[str, Any] = {}
    mb = dict(r.micro_batch_metrics or {})
    m = None
    if mb:
        missing = [k for k in S.MICRO_BATCH_REQUIRED if k not in mb]
        if missing:
            raise _fail("micro_batch_metrics", f"missing required column(s) {missing}")
        m = len(np.asarray(mb["update"]))
    if r.micro_batch_sample_offsets is not None or r.micro_batch_samples is not None:
        if r.micro_batch_sample_offsets is None or r.micro_batch_samples is None:
            raise _fail("micro_batch_samples", "micro_batch_samples and micro_batch_sample_offsets go together")
        ms = _as_int("micro_batch_samples", r.micro_batch_samples, np.int64)
        moff = _as_int("micro_batch_sample_offsets", r.micro_batch_sample_offsets, np.int64)
        _check_index("micro_batch_samples", ms, n)
        _check_offsets("micro_batch_sample_offsets", moff, ms.size, "len(micro_batch_samples)")
        if m is not None and moff.size - 1 != m:
            raise _fail("micro_batch_sample_offsets", f"describes {moff.size - 1} micro-batches, "
                        f"micro_batch_metrics has M={m}")
        m = moff.size - 1
        ds["/train/micro_batch_samples"] = ms
        ds["/train/micro_batches/sample_offsets"] = moff
    if m is None:
        m = 0
    ds.update(_metric_columns("micro_batch_metrics", mb, S.G_MICRO_BATCHES, S.MICRO_BATCH_REQUIRED,
                              S.MICRO_BATCH_RESERVED, m, "M"))
    upd = ds[f"{S.G_MICRO_BATCHES}/update"]
    if upd.size and (upd.min() < 0 or upd.max() >= u or bool((np.diff(upd) < 0).any())):
        raise _fail("micro_batch_metrics['update']", f"must be non-decreasing update indices in [0, U={u})")
    return ds, m


_POOL_SAMPLE_GROUPS = (S.G_POOL_SAMPLES + "/", S.G_POOL_TOKENS + "/", S.G_POOL_ROUTING + "/")


def _pool(r: StepRecord) -> dict[str, Any]:
    """The optional /pool datasets; those of one symbolic dimension must share its length."""
    ds: dict[str, Any] = {}
    lengths_of: dict[str, tuple[int, str]] = {}
    for spec in S.DATASETS:
        value = getattr(r, spec.field) if spec.path.startswith(S.G_POOL + "/") else None
        if value is None or spec.path.startswith(_POOL_SAMPLE_GROUPS):
            continue
        a = _as_spec_dtype(spec, value)
        dim = spec.shape[0]
        if a.ndim != 1:
            raise _fail(spec.field, f"must be 1-D ({dim}), got shape {a.shape}")
        if dim in lengths_of and lengths_of[dim][0] != a.size:
            raise _fail(spec.field, f"has {a.size} entries, {lengths_of[dim][1]} has {lengths_of[dim][0]} ({dim})")
        lengths_of.setdefault(dim, (a.size, spec.field))
        ds[spec.path] = a
    ds.update(_pool_samples(r, ds.get("/pool/dropped_group_id")))
    return ds


def _pool_samples(r: StepRecord, dropped: np.ndarray | None) -> dict[str, Any]:
    """/pool/samples, /pool/tokens, /pool/routing: all or none (routing optional), in their own CSR;
    every sample's group among /pool/dropped_group_id."""
    specs = [s for s in S.DATASETS if s.path.startswith(_POOL_SAMPLE_GROUPS)]
    given = [s for s in specs if getattr(r, s.field) is not None]
    if not given:
        return {}
    missing = [s.field for s in specs if getattr(r, s.field) is None and s.field != "pool_routing_rollout"]
    if missing:
        raise _fail(missing[0], f"is required with the other pool sample fields ({given[0].field} is given)")
    off = _as_int("pool_sample_offsets", r.pool_sample_offsets, np.int64)
    _check_offsets("pool_sample_offsets", off, None, "DT")
    n, t = off.size - 1, int(off[-1])
    ds: dict[str, Any] = {"/pool/samples/offsets": off}
    for spec in specs:
        if spec.field in ("pool_sample_offsets", "pool_routing_rollout"):
            continue
        a = _as_spec_dtype(spec, getattr(r, spec.field))
        dim = spec.shape[0]
        _check_shape(spec.field, a, (n if dim == "DN" else t,),
                     "DN = len(pool_sample_offsets) - 1" if dim == "DN" else "DT = pool_sample_offsets[-1]")
        ds[spec.path] = a
    groups = ds["/pool/samples/group_id"]
    if groups.size and (dropped is None or not np.isin(groups, dropped).all()):
        raise _fail("pool_group_id", "every pool sample's group must be in pool_dropped_group_id")
    if r.pool_routing_rollout is not None:
        if r.num_experts is None:
            raise _fail("num_experts", "is required when pool routing is recorded")
        a = np.asarray(r.pool_routing_rollout)
        if a.ndim != 3 or a.shape[0] != t:
            raise _fail("pool_routing_rollout", f"shape {a.shape}, expected (DT={t}, L, k)")
        if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= int(r.num_experts)):
            raise _fail("pool_routing_rollout", f"expert ids must be integers in [0, num_experts={r.num_experts})")
        ds["/pool/routing/rollout"] = np.ascontiguousarray(a, dtype=S.routing_dtype(int(r.num_experts)))
    return ds


def _extras(r: StepRecord, n: int, t: int) -> dict[str, Any]:
    """The recorder's extra per-sample and per-token columns (never a schema dataset's name)."""
    ds: dict[str, Any] = {}
    for where, group, length, lname in (("extra_samples", S.G_SAMPLES, n, "N"),
                                        ("extra_tokens", S.G_TOKENS, t, "T")):
        for k, v in (getattr(r, where) or {}).items():
            _check_name(where, k)
            path = f"{group}/{k}"
            if path in S.DATASETS_BY_PATH:
                raise _fail(where, f"{k!r} collides with the schema dataset {path}")
            ds[path] = _as_extra(where, k, v, length, lname)
    return ds


def _root_attrs(r: StepRecord, n: int, t: int, u: int, m: int) -> dict[str, Any]:
    """The file's root attributes: the reserved ones, wall times per phase, the recorder's own."""
    from .. import __version__ as axrl_version

    root: dict[str, Any] = {
        S.ATTR_STEP: np.int64(r.step),
        S.ATTR_SCHEMA_VERSION: np.int64(S.SCHEMA_VERSION),
        S.ATTR_POLICY_VERSION: np.int64(r.policy_version),
        S.ATTR_RNG_DIGEST: _as_str("rng_digest", r.rng_digest),
        S.ATTR_AXRL_VERSION: axrl_version,
        S.ATTR_CREATED_UNIX: np.float64(time.time()),
        S.ATTR_NUM_SAMPLES: np.int64(n),
        S.ATTR_NUM_TOKENS: np.int64(t),
        S.ATTR_NUM_UPDATES: np.int64(u),
        S.ATTR_NUM_MICRO_BATCHES: np.int64(m),
    }
    for phase, secs in (r.wall_times or {}).items():
        _check_name("wall_times", phase)
        try:
            secs = float(secs)
        except (TypeError, ValueError):
            raise _fail(f"wall_times[{phase!r}]", f"expected seconds as a float, got {secs!r}") from None
        root[S.WALL_TIME_PREFIX + phase] = np.float64(secs)
    for k, v in (r.attrs or {}).items():
        _check_name("attrs", k)
        if k in S.RESERVED_ROOT_ATTRS or k.startswith(S.WALL_TIME_PREFIX):
            raise _fail("attrs", f"attribute name {k!r} is reserved")
        root[k] = _as_attr(f"attrs[{k!r}]", v)
    return root
