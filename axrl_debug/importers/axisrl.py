"""AxisRL spike snapshots (``spike_snapshots/iter_N/batch_rank{r}.pt``) → an AxRL run.

Each ``batch_rank{r}.pt`` is a TensorDict of [B, S] tensors: ``input_ids``, ``labels``,
``loss_mask``, ``rollout_logprobs``, ``old_logprobs``, ``advantage`` ([B, S] or [B]), ``reward``
[B], optionally ``attention_mask`` (each row's length; without it a row is all tokens),
``ref_logprobs`` and ``group_ids``/``uid`` (without them each sample is its own group). Every
per-token column is *label-aligned*: entry j concerns ``labels[j] = input_ids[j + 1]`` — one
place left of AxRL's alignment — so the importer moves them one place right (checking the
labels agree with the shifted ids). AxisRL's package is also named ``axrl``: its classes (and
TensorDict's) are mapped to plain dicts by the restricted unpickler, never imported.

R3 routing: the batch carries, as the non-tensor ``routing_handles_per_path``, per row a list of
paths, each a list of tensor-store handles (``ref``, ``row_start``, ``row_count``); the handles'
payloads are saved beside it as ``routing_payload_rank{r}.pt``: a list of int16 arrays
[rows, layers, k], one per distinct handle in first-seen order (rows, then paths, then handles).
A flat row (one path) has the routing of its path, the concatenation of its handles' payloads:
[len − 1, layers, k], per token as input (the last token is never fed). Rows merged from several
paths (a prefix trie) are rebuilt by AxisRL from a merge map this importer does not read: the
routing of such a step is left out, and the import report says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .common import ImportedStep, ImportOptions, need, shift_label_aligned
from .safe_load import DEFAULT_STUBS, ImportFormatError, as_numpy, load_dump

ENGINE, BACKEND = None, None
ABSENT = ["trainer routing (/routing/train)", "per-update metrics (/train/updates)", "entropy",
          "weight fingerprints"]
STUBS = DEFAULT_STUBS + ("axrl",)        # AxisRL's own package: never import it (it would be this one)
_ITER_RE = re.compile(r"^iter_(\d+)$")
_RANK_RE = re.compile(r"^batch_rank(\d+)\.pt$")
ROUTING_KEY = "routing_handles_per_path"
IGNORE_INDEX = -100                      # labels of positions that predict nothing


def _iterations(src: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of every ``iter_N`` under ``src`` (or ``src`` itself)."""
    dirs = [src] if _ITER_RE.match(src.name) else sorted(p for p in src.rglob("iter_*") if p.is_dir())
    out = [(int(_ITER_RE.match(d.name).group(1)), d) for d in dirs if _ITER_RE.match(d.name)]
    if not out:
        raise ImportFormatError(f"{src}: no spike_snapshots/iter_N directory in it")
    return sorted(out)


def _matrix(td: dict, key: str, where: str, shape: tuple[int, ...] | None) -> np.ndarray:
    a = as_numpy(need(td, key, where), f"{where}.{key}")
    if a.ndim != 2 or (shape is not None and a.shape != shape):
        raise ImportFormatError(f"{where}: field '{key}' has shape {a.shape}, expected {shape or '(B, S)'}")
    return a


def _lengths(td: dict, where: str, shape: tuple[int, int]) -> np.ndarray:
    if td.get("attention_mask") is None:
        return np.full(shape[0], shape[1], np.int64)
    am = _matrix(td, "attention_mask", where, shape).astype(np.int64)
    n = am.sum(axis=1)
    # rows are trimmed to their first n tokens: a left-padded (or holed) row would be cut wrong
    bad = np.flatnonzero(am != (np.arange(shape[1])[None, :] < n[:, None]))
    if bad.size:
        b = int(bad[0] // shape[1])
        raise ImportFormatError(f"{where}: row {b}: attention_mask is not ones then zeros (right padding); "
                                "rows padded on the left cannot be trimmed to their tokens")
    return n


def _rank_rows(td: Any, where: str) -> list[dict[str, Any]]:
    """The samples of one rank's batch at AxRL's alignment (tokens' own positions), padding trimmed."""
    ids = _matrix(td, "input_ids", where, None).astype(np.int64)
    labels = _matrix(td, "labels", where, ids.shape).astype(np.int64)
    cols = {k: _matrix(td, k, where, ids.shape) for k in ("loss_mask", "rollout_logprobs", "old_logprobs")}
    ref = _matrix(td, "ref_logprobs", where, ids.shape) if td.get("ref_logprobs") is not None else None
    adv = as_numpy(need(td, "advantage", where), f"{where}.advantage")
    reward = as_numpy(need(td, "reward", where), f"{where}.reward").reshape(-1)
    if adv.shape not in (ids.shape, (ids.shape[0],)) or reward.shape != (ids.shape[0],):
        raise ImportFormatError(f"{where}: 'advantage' {adv.shape} / 'reward' {reward.shape}, expected "
                                f"{ids.shape} or ({ids.shape[0]},) / ({ids.shape[0]},)")
    groups = next((np.asarray(_keys(td[k], f"{where}.{k}")) for k in ("group_ids", "uid") if td.get(k) is not None),
                  None)
    if groups is not None and groups.shape != (ids.shape[0],):
        raise ImportFormatError(f"{where}: group ids of shape {groups.shape}, expected ({ids.shape[0]},)")
    rows = []
    for b, n in enumerate(_lengths(td, where, ids.shape)):
        lab = labels[b, :n - 1]
        bad = np.flatnonzero((lab != IGNORE_INDEX) & (lab != ids[b, 1:n]))
        if bad.size:
            raise ImportFormatError(f"{where}: row {b}: labels[{bad[0]}] = {lab[bad[0]]} is not input_ids[{bad[0] + 1}] "
                                    f"= {ids[b, bad[0] + 1]} (expected label-aligned columns)")
        mask = shift_label_aligned(cols["loss_mask"][b, :n].astype(np.int64), 0)
        a = adv[b, :n] if adv.ndim == 2 else None
        rows.append({"ids": ids[b, :n], "mask": mask,
                     "rollout": shift_label_aligned(cols["rollout_logprobs"][b, :n].astype(np.float64), np.nan),
                     "trainer": shift_label_aligned(cols["old_logprobs"][b, :n].astype(np.float64), np.nan),
                     "ref": None if ref is None else shift_label_aligned(ref[b, :n].astype(np.float64), np.nan),
                     "advantages": (np.where(mask == 1, float(adv[b]), 0.0) if a is None
                                    else shift_label_aligned(a.astype(np.float64), 0.0)),
                     "reward": float(reward[b]), "group": None if groups is None else groups[b]})
    return rows


def _keys(value: Any, where: str) -> list[Any]:
    """A row's group key: a number (``group_ids``) or a string (``uid``, e.g. a prompt's uuid)."""
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.dtype.kind in "OUS"):
        return [str(v) if isinstance(v, (str, bytes, np.str_)) else v for v in np.asarray(value, object).reshape(-1)]
    return as_numpy(value, where).reshape(-1).tolist()


def _group_ids(rows: list[dict[str, Any]]) -> list[int]:
    """Integer group ids: the rows' integer ids as they are, string keys (uuids) numbered by first
    appearance across the ranks."""
    keys = [r["group"] for r in rows]
    if all(isinstance(k, (int, np.integer)) for k in keys):
        return [int(k) for k in keys]
    numbered: dict[Any, int] = {}
    return [numbered.setdefault(k, len(numbered)) for k in keys]


def _handle_key(h: Any, where: str) -> tuple:
    """A tensor-store handle (a dict of its fields once unpickled) as a hashable key."""
    if not isinstance(h, dict) or "ref" not in h:
        raise ImportFormatError(f"{where}: a routing handle should hold 'ref', 'row_start', 'row_count'; got "
                                f"{type(h).__name__}")
    return tuple(sorted((k, str(v)) for k, v in h.items()))


def _rank_routing(td: Any, f: Path, rows: list[dict[str, Any]], options: ImportOptions) -> str | None:
    """Attach each row's routing ("routing" [len − 1, L, k]) from ``routing_payload_rank{r}.pt``;
    return a note when the rank's routing cannot be imported (None when it was, or there is none)."""
    paths_per_row = td.get(ROUTING_KEY) if isinstance(td, dict) else None
    payload_file = f.with_name(f.name.replace("batch_rank", "routing_payload_rank"))
    if paths_per_row is None or not payload_file.exists():
        return None if paths_per_row is None else f"{f}: {ROUTING_KEY} without {payload_file.name}: routing left out"
    where = f"{f}: {ROUTING_KEY}"
    if not isinstance(paths_per_row, list) or len(paths_per_row) != len(rows):
        raise ImportFormatError(f"{where}: expected one list of paths per row ({len(rows)} rows)")
    if any(not isinstance(p, list) or len(p) != 1 for p in paths_per_row):
        return f"{f}: rows merged from several paths (a prefix trie): routing left out"
    order: dict[tuple, int] = {}
    for b, (path,) in enumerate(paths_per_row):
        for h in path:
            order.setdefault(_handle_key(h, f"{where}[{b}]"), len(order))
    payloads = load_dump(payload_file, trust=options.trust_pickle, stubs=STUBS)
    if not isinstance(payloads, list) or len(payloads) != len(order):
        raise ImportFormatError(f"{payload_file}: expected a list of {len(order)} routing arrays (one per distinct "
                                f"handle of {f.name}), got {type(payloads).__name__} of {len(payloads) if isinstance(payloads, list) else '?'}")
    arrays = [as_numpy(p, f"{payload_file}[{i}]") for i, p in enumerate(payloads)]
    for b, ((path,), row) in enumerate(zip(paths_per_row, rows)):
        parts = [arrays[order[_handle_key(h, where)]] for h in path]
        r = np.concatenate(parts) if parts else np.zeros((0, 1, 1), np.int64)
        if r.ndim != 3 or r.shape[0] != len(row["ids"]) - 1:
            raise ImportFormatError(f"{payload_file}: row {b}'s routing has shape {r.shape}, expected "
                                    f"({len(row['ids']) - 1}, layers, k) (the row's length − 1)")
        row["routing"] = r.astype(np.int64)
    return None


def _step(it: int, d: Path, options: ImportOptions) -> ImportedStep:
    files = sorted((int(_RANK_RE.match(p.name).group(1)), p) for p in d.iterdir() if _RANK_RE.match(p.name))
    if not files:
        raise ImportFormatError(f"{d}: no batch_rank{{r}}.pt in it")
    rows, notes = [], []
    for _, f in files:
        td = load_dump(f, trust=options.trust_pickle, stubs=STUBS)
        rank_rows = _rank_rows(td, str(f))
        note = _rank_routing(td, f, rank_rows, options)
        notes += [note] if note else []
        rows += rank_rows
    groups = _group_ids([r if r["group"] is not None else {**r, "group": i} for i, r in enumerate(rows)])
    routed = [r.get("routing") for r in rows]
    if any(r is not None for r in routed) and any(r is None for r in routed):
        notes.append(f"{d}: routing of some ranks only: left out for the step")
    return ImportedStep(
        step=it, token_ids=[r["ids"] for r in rows], loss_mask=[r["mask"] for r in rows],
        rollout_logprobs=[r["rollout"] for r in rows], trainer_logprobs=[r["trainer"] for r in rows],
        advantages=[r["advantages"] for r in rows], rewards=[r["reward"] for r in rows], group_ids=groups,
        ref_logprobs=[r["ref"] for r in rows] if all(r["ref"] is not None for r in rows) else None,
        routing=routed if all(r is not None for r in routed) else None,
        files=[str(f) for _, f in files], notes=notes)


def read_steps(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """The steps (one per snapshot iteration) of an AxisRL ``spike_snapshots`` directory."""
    for it, d in _iterations(Path(src)):
        yield _step(it, d, options)
