"""`ServerFleetSettings`: what every HTTP rollout engine's config section shares — servers to
connect to, or how many to launch and where, the server's own Python environment and flags, and
the client's HTTP limits. `rollout.sglang` and `rollout.vllm` extend it. Light (pydantic only):
the config reads it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ServerFleetSettings"]


class ServerFleetSettings(BaseModel):
    """Connect to running servers (`urls`) or launch `num_servers` of them from `base_port`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Flags the launcher sets itself (model directory, host, port); a subclass names its model flag.
    LAUNCHER_FLAGS: ClassVar[frozenset[str]] = frozenset({"--host", "--port"})

    urls: list[str] = Field(default_factory=list, description="connect to these servers instead of launching")
    num_servers: int = Field(1, ge=1)
    base_port: int = Field(30000, ge=1, le=65535, description="first port tried; busy ones are skipped")
    python: str | None = Field(None, description="interpreter of the server's environment (default: this one)")
    server_args: list[str] = Field(default_factory=list, description="extra flags for every server")
    startup_timeout_s: float = Field(300.0, gt=0)
    log_dir: str | None = Field(None, description="server logs (default: last lines kept in memory)")
    weight_sync: Literal["disk", "distributed"] = "disk"
    export_dir: str | None = Field(None, description="HF directories for start-up and disk sync (default: temp)")
    max_concurrency: int = Field(64, ge=1, description="HTTP requests in flight")
    timeout_s: float = Field(600.0, gt=0, description="per-request timeout")
    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.5, ge=0, description="first retry delay, doubled each retry")
    watchdog_s: float = Field(0.0, ge=0, description="restart crashed launched servers every K s (0 = on failure only)")

    @model_validator(mode="after")
    def _check_fleet(self) -> "ServerFleetSettings":
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"urls: {bad[0]!r} is not an http(s) URL such as http://127.0.0.1:30000")
        taken = self.LAUNCHER_FLAGS & {a.split("=")[0] for a in self.server_args}
        if taken:
            raise ValueError(f"server_args: {sorted(taken)} are set by the launcher (model export, base_port)")
        return self
