"""What moves by object reference, and how big it is.

A `Shard` is one train rank's rows of a packed batch, put in the object store once; the rank
fetches only its own shard (never the whole batch). A `WeightsHandle` is a snapshot of the train
group's weights that rank 0 put in the object store: engines fetch it themselves, so weight sync
never passes through the driver. `payload_bytes` measures tensors and arrays inside any result,
for the per-rank shares and the tensor bytes of actor calls (`DataPlane`, read by
bench/ray_data_plane.py); what crosses the driver and what is put by reference is measured at
Ray's serialised size (axrl/ray_executor/wire.py).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from axrl.train.protocol import PackedBatch


def payload_bytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in `obj` (dataclasses, mappings and sequences walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj) if obj and not isinstance(obj[0], (int, float)) else 8 * len(obj)
    return 0


def shard_rows(batch: PackedBatch, ranks: int) -> list[list[int]]:
    """Contiguous sample ranges, one per rank, balanced by tokens: sample i goes to the rank whose
    share of the token stream holds its midpoint. Batch order is kept, so the ranks' per-token
    outputs concatenate back into the batch's order. A rank may get no sample."""
    lengths = batch.lengths.tolist()
    total = max(sum(lengths), 1)
    out: list[list[int]] = [[] for _ in range(ranks)]
    before = 0
    for i, n in enumerate(lengths):
        out[min(ranks - 1, int((before + n / 2) * ranks // total))].append(i)
        before += n
    return out


def rank_label(rank: int, kind: str = "train") -> str:
    """A rank's name in activity tables and the data-plane account ("train rank 0", "megatron rank 1")."""
    return f"{kind} rank {rank}"


@dataclass
class WeightsHandle:
    """Weights version `version` of the train group, in the object store (HF names). Engines
    resolve `ref` themselves; the driver only passes it on."""

    ref: Any
    version: int | None = None
    nbytes: int = 0


@dataclass
class DataPlane:
    """Bytes per category that a process sent or received.

    In the driver (`in_driver`), `driver` holds what really crossed the driver, measured by
    `wire.DriverWire` at Ray's serialised size (every `ray.get` / `ray.put` / actor call / actor
    start of the driver process, each object once); the handles' own `moved` and `by_reference`
    add nothing there (the wire sees those bytes). In an actor, `by_reference` counts an object
    the actor put in the object store for another actor, once, at its serialised size
    (`wire.wire_bytes`), and `moved` the tensor and array bytes (`payload_bytes`) of an actor
    call's arguments or answer between actors (`actor_calls`: not serialised sizes, not in the
    driver fraction); both are folded into the driver's with `merge`. Per rank (by label: "train
    rank 0", "megatron rank 1"), the tensor bytes of its share as the sender counted them, and
    what the rank itself says it fetched. Thread-safe."""

    in_driver: bool = True
    driver: dict[str, int] = field(default_factory=dict)
    by_ref: dict[str, int] = field(default_factory=dict)
    actor_calls: dict[str, int] = field(default_factory=dict)
    rank_share: dict[str, int] = field(default_factory=dict)
    rank_fetched: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def crossed(self, category: str, nbytes: int) -> None:
        """`nbytes` (serialised, measured) that crossed the driver process."""
        self._add(self.driver, category, nbytes)

    def moved(self, category: str, nbytes: int) -> None:
        """`nbytes` of tensors and arrays in an actor call between actors (nothing in the driver:
        what the driver sends or receives, the wire measures)."""
        if not self.in_driver:
            self._add(self.actor_calls, category, nbytes)

    def by_reference(self, category: str, nbytes: int) -> None:
        """An object of `nbytes` (serialised) this actor put in the object store for another
        actor; call it once per object (nothing in the driver: the wire counts its puts)."""
        if not self.in_driver:
            self._add(self.by_ref, category, nbytes)

    def _add(self, where: dict[str, int], category: str, nbytes: int) -> None:
        with self._lock:
            where[category] = where.get(category, 0) + nbytes

    def shared(self, rank: str, nbytes: int) -> None:
        """`nbytes` sent to `rank` as its share (counted by the sender)."""
        self._add(self.rank_share, rank, nbytes)

    def fetched(self, rank: str, nbytes: int) -> None:
        """`nbytes` that `rank` says it fetched."""
        self._add(self.rank_fetched, rank, nbytes)

    def merge(self, snapshot: dict[str, Any]) -> None:
        """Fold in an actor's `snapshot()`: all it counted moved between actors, not through the driver."""
        for part, where in (("by_ref", self.by_ref), ("actor_calls", self.actor_calls),
                            ("rank_share", self.rank_share), ("rank_fetched", self.rank_fetched)):
            for key, n in snapshot.get(part, {}).items():
                self._add(where, key, n)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"driver": dict(self.driver), "by_ref": dict(self.by_ref), "actor_calls": dict(self.actor_calls),
                    "rank_share": dict(self.rank_share), "rank_fetched": dict(self.rank_fetched)}
