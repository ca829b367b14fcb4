"""`SGLangSettings`: how the SGLang rollout engine is reached — servers to connect to, or how to
launch them, weight sync and the client's HTTP limits. Light (pydantic only): the config reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SGLangSettings", "ServedModel"]


class SGLangSettings(BaseModel):
    """`rollout.engine: sglang`: connect to running servers (`urls`) or launch them (docs/sglang.md).
    The YAML section `rollout.sglang` is this type (one schema for the config and the factory)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    urls: list[str] = Field(default_factory=list, description="connect to these servers instead of launching")
    server: Literal["sglang", "axrl"] = Field("sglang", description="what the launcher starts: "
                                              "sglang.launch_server or `axrl serve`")
    num_servers: int = Field(1, ge=1)
    base_port: int = Field(30000, ge=1, le=65535, description="first port tried; busy ones are skipped")
    python: str | None = Field(None, description="interpreter of the SGLang environment (default: this one)")
    cpu_compat: bool = Field(False, description="start SGLang through cpu_compat.py (CPU-only debugging aid)")
    server_args: list[str] = Field(default_factory=list, description="extra flags for every server")
    startup_timeout_s: float = Field(300.0, gt=0)
    log_dir: str | None = Field(None, description="server logs (default: last lines kept in memory)")
    weight_sync: Literal["disk", "distributed"] = "disk"
    sync_backend: Literal["gloo", "nccl"] = Field("gloo", description="process-group backend of distributed sync")
    export_dir: str | None = Field(None, description="HF directories for start-up and disk sync (default: temp)")
    max_concurrency: int = Field(64, ge=1, description="HTTP requests in flight")
    timeout_s: float = Field(600.0, gt=0, description="per-request timeout")
    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.5, ge=0, description="first retry delay, doubled each retry")
    watchdog_s: float = Field(0.0, ge=0, description="restart crashed launched servers every K s (0 = on failure only)")

    @model_validator(mode="after")
    def _check(self) -> "SGLangSettings":
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"urls: {bad[0]!r} is not an http(s) URL such as http://127.0.0.1:30000")
        taken = {"--model-path", "--host", "--port"} & {a.split("=")[0] for a in self.server_args}
        if taken:
            raise ValueError(f"server_args: {sorted(taken)} are set by the launcher (model export, base_port)")
        return self


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
