"""`SGLangSettings`: how the SGLang rollout engine is reached — servers to connect to, or how to
launch them, weight sync and the client's HTTP limits (the fields every server engine has are
`ServerFleetSettings`'s). Light (pydantic only): the config reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from axrl.inference.remote.settings import ServerFleetSettings

__all__ = ["SGLangSettings", "ServedModel"]


class SGLangSettings(ServerFleetSettings):
    """`rollout.engine: sglang`: connect to running servers (`urls`) or launch them (docs/sglang.md).
    The YAML section `rollout.sglang` is this type (one schema for the config and the factory)."""

    LAUNCHER_FLAGS: ClassVar[frozenset[str]] = frozenset({"--model-path", "--host", "--port"})

    server: Literal["sglang", "axrl"] = Field("sglang", description="what the launcher starts: "
                                              "sglang.launch_server or `axrl serve`")
    cpu_compat: bool = Field(False, description="start SGLang through cpu_compat.py (CPU-only debugging aid)")
    sync_backend: Literal["gloo", "nccl"] = Field("gloo", description="process-group backend of distributed sync")


@dataclass(frozen=True)
class ServedModel:
    """What every launched server is told about the run: engine slots, context, seed of requests
    without one, threads, dtype, and whether the prefix cache is on (the run's own setting)."""

    max_batch_size: int = 64
    max_context_len: int = 512
    seed: int = 0
    threads: int = 1
    dtype: str = "float32"
    prefix_cache: bool = False
