"""The Ray executor's settings — the YAML section `runtime.ray` is `RaySettings` (one schema for the
config and the executor). Light (pydantic only): reading a config imports no Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RayPlacementSettings", "RaySettings"]


class RayPlacementSettings(BaseModel):
    """Where the Ray actors go (docs/distributed.md). `colocated`: one placement group holding the
    train ranks and the engine; `separate`: one group for the train ranks, one for the engine."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    mode: Literal["colocated", "separate"] = "colocated"
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement-group strategy of each group (Ray's names)")
    train_cpus: float = Field(1.0, gt=0, description="CPUs reserved per train rank")
    engine_cpus: float = Field(1.0, gt=0, description="CPUs reserved per engine actor")
    train_gpus: float = Field(0.0, ge=0, description="GPUs reserved per train rank (fractions share a GPU: "
                                                     "with engine_gpus, colocate engine and trainer on it)")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the engine actor (or the SGLang "
                                                      "servers' rollout actor)")
    timeout_s: float = Field(30.0, gt=0, description="wait this long for the placement groups before "
                                                     "refusing the placement")


class RaySettings(BaseModel):
    """`runtime.executor: ray` (docs/distributed.md); the YAML section `runtime.ray` is this type."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    address: str | None = Field(None, description="connect to this cluster (host:port of the head, or 'auto'); "
                                                  "null starts a local one")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local cluster started for the run")
    train_ranks: int = Field(1, ge=1, description="data-parallel torch ranks, one actor each (gloo group)")
    engine_restarts: int = Field(2, ge=0, description="restarts of a dead engine actor (its requests in "
                                                      "flight are re-run) before the run fails")
    rollout_restarts: int = Field(2, ge=0, description="restarts of a dead rollout actor (the groups it had "
                                                       "not handed over are re-run) before the run fails")
    train_restarts: int = Field(2, ge=0, description="restarts of the train group from the last checkpoint "
                                                     "after a train actor died, before the run stops")
    call_timeout_s: float = Field(600.0, gt=0, description="a call to an actor that takes longer fails the actor")
    heartbeat_s: float = Field(2.0, gt=0, description="how often the driver polls every actor's heartbeat "
                                                      "into RUN/status.json (`axrl status RUN`)")
    placement: RayPlacementSettings = Field(default_factory=RayPlacementSettings)
