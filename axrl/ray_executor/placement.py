"""Placement groups for a run's actors (`runtime.ray.placement`).

`colocated`: one group whose bundles are the train ranks and the engine, so that PACK puts them
on as few nodes as fit; `separate`: one group for the train ranks and one for the engine, each
with the strategy, so the two sides can take different nodes. A placement the cluster cannot
hold is refused before any actor starts, naming the keys: at once when the cluster's CPUs
cannot cover it, otherwise when the groups are not ready within `placement.timeout_s`. A driver
that runs no engine (the training service) places the train ranks alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from axrl.core.errors import ConfigError
from axrl.runtime.components import BackendSettings
from axrl.ray_executor.settings import RayPlacementSettings


@dataclass
class Slot:
    """Where one actor goes: a placement group and a bundle index in it."""

    group: Any
    bundle: int
    cpus: float
    gpus: float = 0.0

    def options(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.cpus, "num_gpus": self.gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.bundle)}


@dataclass
class Placement:
    train: list[Slot]
    engine: Slot | None            # None: placed without an engine (`place(..., engine=False)`)
    groups: list[Any] = field(default_factory=list)

    def release(self, ray: ModuleType) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001 — the cluster may already be gone at shutdown
                pass
        self.groups = []


def train_slots(backend: BackendSettings, train_ranks: int) -> int:
    """Train actors that need a slot: the torch ranks, or the Megatron world (tensor × data parallel)."""
    if backend.kind == "megatron":
        from axrl.train.megatron.settings import auto_data_parallel  # no megatron-core import

        m = backend.config
        return m.tensor_parallel * (m.data_parallel or auto_data_parallel(m.tensor_parallel, m.expert_parallel))
    return train_ranks


def _describe(p: RayPlacementSettings, ranks: int, engine: bool) -> str:
    gpus = (f" (train_gpus={p.train_gpus}" + (f", engine_gpus={p.engine_gpus}" if engine else "") + ")"
            if p.train_gpus or (engine and p.engine_gpus) else "")
    return (f"runtime.ray.placement (mode {p.mode}, strategy {p.strategy}): {ranks} train rank(s) × "
            f"train_cpus={p.train_cpus}" + (f" + 1 engine × engine_cpus={p.engine_cpus}" if engine else "") + gpus)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def place(ray: ModuleType, p: RayPlacementSettings, ranks: int, engine: bool = True) -> Placement:
    """Reserve the run's placement groups for `ranks` train actors and (with `engine`) the
    engine, or raise ConfigError naming the keys."""
    from ray.util.placement_group import placement_group

    resources = ray.cluster_resources()
    on_engine = 1 if engine else 0
    for kind, need in (("CPU", ranks * p.train_cpus + on_engine * p.engine_cpus),
                       ("GPU", ranks * p.train_gpus + on_engine * p.engine_gpus)):
        have = float(resources.get(kind, 0.0))
        if need > have:
            raise ConfigError(f"{_describe(p, ranks, engine)} needs {need:g} {kind}s; the cluster has {have:g} "
                              f"(lower runtime.ray.train_ranks or the *_{kind.lower()}s, or add nodes)")
    train_bundles = [_bundle(p.train_cpus, p.train_gpus) for _ in range(ranks)]
    engine_bundle = _bundle(p.engine_cpus, p.engine_gpus)
    if not engine:
        groups = [placement_group(train_bundles, strategy=p.strategy)]
    elif p.mode == "colocated":
        groups = [placement_group(train_bundles + [engine_bundle], strategy=p.strategy)]
    else:
        groups = [placement_group(train_bundles, strategy=p.strategy), placement_group([engine_bundle], strategy=p.strategy)]
    placement = Placement(train=[], engine=None, groups=groups)
    ready = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=p.timeout_s)[0]
    if len(ready) < len(groups):
        placement.release(ray)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = sorted((float(n["Resources"].get("CPU", 0)) for n in nodes), reverse=True)
        raise ConfigError(f"{_describe(p, ranks, engine)} cannot be placed within runtime.ray.placement.timeout_s="
                          f"{p.timeout_s:g} s on {len(nodes)} node(s) with CPUs {per_node} (STRICT_PACK needs one "
                          "node holding every bundle, STRICT_SPREAD one node per bundle; free CPUs may be taken "
                          "by other work)")
    placement.train = [Slot(groups[0], i, p.train_cpus, p.train_gpus) for i in range(ranks)]
    if engine:
        placement.engine = (Slot(groups[0], ranks, p.engine_cpus, p.engine_gpus) if p.mode == "colocated"
                            else Slot(groups[1], 0, p.engine_cpus, p.engine_gpus))
    return placement
