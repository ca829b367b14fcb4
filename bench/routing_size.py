"""Stored routing size against the routing's own entropy (used by ``bench/trace_scale.py``).

R3 replays the engine's expert lists in the engine's order, so the information a routing trace
must keep per (token, layer) is the *ordered* top-k tuple. Its entropy is measured per layer —
the plug-in entropy of the ordered k-tuples of that layer's valid rows — and averaged over the
layers (``ordered_entropy_bits``). Against it: the bytes the ``packed`` encoding
(``axrl.trace.routing_codec``) stores for the engine's routing (``packed_rollout_bytes``), and,
for the pair, the trainer's routing as stored (its difference marks and rows) against its
conditional information estimated the same way (``train_given_rollout_bits``).

The plug-in estimate is unbiased only when the rows far outnumber the distinct tuples; each
source reports both counts (``rows_per_layer``, ``distinct_tuples``) so the reader can judge.
For uniform, independent ids (the synthetic step) the entropy is known by construction,
k · log₂ E bits, and is given instead of an estimate (a plug-in estimate of 2⁵⁶ outcomes from
10⁶ rows would say ≈ 20 bits).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from axrl.trace import StepFile, routing_codec


def _tuple_keys(layer_ids: np.ndarray) -> np.ndarray:
    """[T, k] ids of one layer → one opaque key per ordered tuple (its bytes), for counting."""
    rows = np.ascontiguousarray(layer_ids)
    return rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()


def _plugin_bits(keys: np.ndarray) -> tuple[float, int]:
    """Plug-in entropy (bits) of the outcomes ``keys`` and how many distinct ones there are."""
    if keys.size == 0:
        return 0.0, 0
    _, counts = np.unique(keys, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum()), int(counts.size)


def ordered_entropy(routing: np.ndarray, valid: np.ndarray | None = None) -> dict[str, float]:
    """Per-layer plug-in entropy of the ordered top-k tuples of ``routing`` [T, L, k] (rows where
    ``valid`` is set), averaged over layers: bits per (token, layer)."""
    rows = routing if valid is None else routing[valid.astype(bool)]
    per_layer = [_plugin_bits(_tuple_keys(rows[:, layer])) for layer in range(rows.shape[1])]
    return {"ordered_entropy_bits": float(np.mean([h for h, _ in per_layer])),
            "entropy_bits_per_layer": [round(h, 4) for h, _ in per_layer],
            "distinct_tuples": max(d for _, d in per_layer), "rows_per_layer": int(rows.shape[0])}


def train_given_rollout_bits(rollout: np.ndarray, train: np.ndarray, valid: np.ndarray | None) -> float:
    """Information in the trainer's routing given the engine's, per (token, layer), estimated per
    layer as H(differs) + P(differs) · H(trainer tuple | differs) (plug-in): what the ``packed``
    encoding's marks and rows carry."""
    if valid is not None:
        rollout, train = rollout[valid.astype(bool)], train[valid.astype(bool)]
    total = []
    for layer in range(rollout.shape[1]):
        differs = (rollout[:, layer] != train[:, layer]).any(axis=1)
        q = float(differs.mean()) if differs.size else 0.0
        h_mark = 0.0 if q in (0.0, 1.0) else -(q * math.log2(q) + (1 - q) * math.log2(1 - q))
        h_rows = _plugin_bits(_tuple_keys(train[differs, layer]))[0] if differs.any() else 0.0
        total.append(h_mark + q * h_rows)
    return float(np.mean(total))


def packed_bytes(rollout: np.ndarray, train: np.ndarray | None, num_experts: int) -> dict[str, int]:
    """Bytes the ``packed`` encoding stores for the routing pair (the arrays ``write_step`` writes
    raw: ``rollout_packed``, ``train_differs``, ``train_rows``, ``train_hits``; chunk checksums aside)."""
    bits = routing_codec.bits_for(num_experts)
    out = {"rollout": int(routing_codec.pack_ids(rollout, bits).nbytes)}
    if train is not None:
        differs, rows, hits = routing_codec.encode_train(train, rollout, bits)
        out["train"] = int(differs.nbytes + rows.nbytes + hits.nbytes)
    return out


def measure(rollout: np.ndarray, train: np.ndarray | None, valid: np.ndarray | None, num_experts: int,
            entropy_bits: float | None = None, sizes: dict[str, int] | None = None) -> dict[str, float]:
    """Stored bytes per (token, layer) over the ordered entropy, for the engine's routing alone (the
    key figure) and for the pair (engine + trainer). ``sizes``: the bytes as stored (``stored_bytes``);
    default the ``packed`` arrays' own bytes (``packed_bytes``, before any compression)."""
    t, layers, _ = rollout.shape
    sizes = sizes or packed_bytes(rollout, train, num_experts)
    ent = ordered_entropy(rollout, valid) if entropy_bits is None else {"ordered_entropy_bits": entropy_bits}
    h = ent["ordered_entropy_bits"]
    row = {**ent, "tokens": t, "layers": layers, "k": rollout.shape[2], "num_experts": num_experts,
           "rollout_bytes_per_token_layer": sizes["rollout"] / (t * layers),
           "entropy_bytes_per_token_layer": h / 8,
           "routing_bytes_over_entropy": sizes["rollout"] / (t * layers) / (h / 8) if h else math.inf}
    if train is not None:
        h_train = train_given_rollout_bits(rollout, train, valid) if entropy_bits is None else 0.0
        pair = (sizes["rollout"] + sizes["train"]) / (t * layers)
        row.update(pair_bytes_per_token_layer=pair, train_given_rollout_bits=h_train,
                   pair_bytes_over_entropy=pair / ((h + h_train) / 8) if h + h_train else math.inf)
    return row


def from_run(run: str | Path) -> dict[str, np.ndarray | int]:
    """The routing of every step of a run's trace, concatenated: rollout, train, valid, num_experts."""
    files = sorted(Path(run, "trace").glob("step_*.h5"))
    if not files:
        raise SystemExit(f"{run}: no trace/step_*.h5 — give a run directory written by `axrl train`")
    parts: dict[str, list[np.ndarray]] = {"rollout": [], "train": [], "valid": []}
    experts = 0
    for path in files:
        with StepFile(path) as sf:
            if "/routing/rollout" not in sf:
                raise SystemExit(f"{path}: no /routing — the run's model is not an MoE")
            rollout = np.asarray(sf["/routing/rollout"])
            parts["rollout"].append(rollout)
            parts["train"].append(np.asarray(sf["/routing/train"]))
            valid = sf["/routing/rollout_valid"] if "/routing/rollout_valid" in sf else np.ones(len(rollout), np.uint8)
            parts["valid"].append(np.asarray(valid))
            experts = int(sf.group_attrs("/routing")["num_experts"])
    return {**{k: np.concatenate(v) for k, v in parts.items()}, "num_experts": experts, "steps": len(files)}


def rank_coded_bytes(routing: np.ndarray) -> dict[str, int]:
    """Bytes of a prototype entropy-coded layout, measured (not a stored encoding of the trace):
    per layer, each row's ordered tuple replaced by its rank in that layer's frequency-sorted
    dictionary, the rank stream compressed with ``lzma`` (range coder) and with ``zlib`` (Huffman),
    the dictionary (distinct tuples × k ids) counted in. Says how far a codec that learns the
    routing's statistics gets below ``packed``."""
    import lzma
    import zlib

    out = {"lzma": 0, "zlib": 0, "dictionary": 0}
    for layer in range(routing.shape[1]):
        keys = _tuple_keys(routing[:, layer])
        uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        rank_of = np.empty(uniq.size, np.int64)
        rank_of[np.argsort(-counts, kind="stable")] = np.arange(uniq.size)
        ranks = rank_of[inverse.ravel()].astype(np.uint8 if uniq.size <= 256 else np.uint32)
        data = ranks.tobytes()
        out["dictionary"] += uniq.size * routing.shape[2] * routing.dtype.itemsize
        out["lzma"] += len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        out["zlib"] += len(zlib.compress(data, 9))
    return out


def stored_bytes(run: str | Path, encoding: str = "packed") -> dict[str, int]:
    """Bytes the routing datasets of a run's steps take on disk when written (``write_step``, the
    writer's real layout, compression included) with ``encoding``: the engine's (``rollout``) and
    the trainer's (``train``: for ``packed`` its marks, rows and their |A ∩ B| counts), ``rollout_valid`` left out."""
    import tempfile

    import h5py

    from axrl.trace import write_step

    out = {"rollout": 0, "train": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted(Path(run, "trace").glob("step_*.h5")):
            with StepFile(path) as sf:
                rec = sf.to_record()
            written = write_step(Path(tmp) / path.stem, rec, routing_encoding=encoding)
            with h5py.File(written, "r") as f:
                for name, ds in f["/routing"].items():
                    if name != "rollout_valid":
                        out["rollout" if name.startswith("rollout") else "train"] += ds.id.get_storage_size()
    return out
