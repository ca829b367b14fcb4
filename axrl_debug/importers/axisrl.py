"""AxisRL spike snapshots (``spike_snapshots/iter_N/batch_rank{r}.pt``) → an AxRL run.

Each ``batch_rank{r}.pt`` is a TensorDict of [B, S] tensors: ``input_ids``, ``labels``,
``loss_mask``, ``rollout_logprobs``, ``old_logprobs``, ``advantage`` ([B, S] or [B]), ``reward``
[B], optionally ``attention_mask`` (each row's length; without it a row is all tokens),
``ref_logprobs`` and ``group_ids``/``uid`` (without them each sample is its own group). Every
per-token column is *label-aligned*: entry j concerns ``labels[j] = input_ids[j + 1]`` — one
place left of AxRL's alignment — so the importer moves them one place right (checking the
labels agree with the shifted ids). AxisRL's package is also named ``axrl``: its classes (and
TensorDict's) are mapped to plain dicts by the restricted unpickler, never imported.
``routing_payload_rank{r}.pt`` is not imported (its layout is not specified; see docs/import.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .common import ImportedStep, ImportOptions, need, shift_label_aligned
from .safe_load import DEFAULT_STUBS, ImportFormatError, as_numpy, load_dump

ENGINE, BACKEND = None, None
ABSENT = ["routing (routing_payload_rank*.pt is not read)", "per-update metrics (/train/updates)", "entropy",
          "weight fingerprints"]
STUBS = DEFAULT_STUBS + ("axrl",)        # AxisRL's own package: never import it (it would be this one)
_ITER_RE = re.compile(r"^iter_(\d+)$")
_RANK_RE = re.compile(r"^batch_rank(\d+)\.pt$")
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
    am = _matrix(td, "attention_mask", where, shape)
    return am.astype(np.int64).sum(axis=1)


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
    groups = next((as_numpy(td[k], k).reshape(-1) for k in ("group_ids", "uid") if td.get(k) is not None), None)
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
                     "reward": float(reward[b]), "group": None if groups is None else int(groups[b])})
    return rows


def _step(it: int, d: Path, options: ImportOptions) -> ImportedStep:
    files = sorted((int(_RANK_RE.match(p.name).group(1)), p) for p in d.iterdir() if _RANK_RE.match(p.name))
    if not files:
        raise ImportFormatError(f"{d}: no batch_rank{{r}}.pt in it")
    rows = [r for _, f in files for r in _rank_rows(load_dump(f, trust=options.trust_pickle, stubs=STUBS), str(f))]
    groups = [r["group"] if r["group"] is not None else i for i, r in enumerate(rows)]
    return ImportedStep(
        step=it, token_ids=[r["ids"] for r in rows], loss_mask=[r["mask"] for r in rows],
        rollout_logprobs=[r["rollout"] for r in rows], trainer_logprobs=[r["trainer"] for r in rows],
        advantages=[r["advantages"] for r in rows], rewards=[r["reward"] for r in rows], group_ids=groups,
        ref_logprobs=[r["ref"] for r in rows] if all(r["ref"] is not None for r in rows) else None,
        files=[str(f) for _, f in files])


def read_steps(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """The steps (one per snapshot iteration) of an AxisRL ``spike_snapshots`` directory."""
    for it, d in _iterations(Path(src)):
        yield _step(it, d, options)
