"""`VLLMSettings`: how the vLLM rollout engine is reached — servers to connect to, or how to
launch them (the fields every server engine has are `ServerFleetSettings`'s), and vLLM's own:
eager mode and the CPU build's KV-cache size. Light (pydantic only): the config reads it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from axrl.inference.remote.settings import ServerFleetSettings

__all__ = ["VLLMSettings"]


class VLLMSettings(ServerFleetSettings):
    """`rollout.engine: vllm`: connect to running vLLM servers (`urls`) or launch them
    (docs/vllm.md). The YAML section `rollout.vllm` is this type."""

    LAUNCHER_FLAGS: ClassVar[frozenset[str]] = frozenset({"--model", "--host", "--port"})

    base_port: int = Field(31000, ge=1, le=65535, description="first port tried; busy ones are skipped")
    enforce_eager: bool = Field(True, description="--enforce-eager: no graph capture (needed on small CPU machines; "
                                                  "turn off on GPUs for CUDA graphs)")
    weight_route: Literal["auto", "reload", "restart"] = Field(
        "auto", description="how launched servers load new weights: in place (reload_weights; on the CPU build "
                            "followed by AxRL's re-packing of the experts, which the reload skips) or by a restart "
                            "on the exported directory; auto = reload (docs/vllm.md)")
    cpu_kv_cache_gb: int = Field(1, ge=1, description="CPU build: KV-cache space in GiB (VLLM_CPU_KVCACHE_SPACE)")

    @model_validator(mode="after")
    def _weight_route(self) -> "VLLMSettings":
        if self.weight_sync == "distributed":
            raise ValueError("rollout.vllm.weight_sync: 'distributed' (vLLM's NCCL weight transfer) is not built yet: "
                             "its trainer side needs the vllm package and a GPU in the trainer's environment; use "
                             "'disk' (pause, reload_weights from the exported directory, resume; docs/vllm.md)")
        return self

    def check_run(self, *, r3: bool, cpu: bool, release_memory: bool, asynchronous: bool) -> None:
        """Refuse, naming the key, what vLLM cannot do in this run (the config calls this)."""
        if asynchronous and self.weight_route == "restart":
            raise ValueError("runtime.mode: async with rollout.vllm.weight_route: restart: a restart drops the "
                             "requests an asynchronous run keeps in flight; use weight_route: reload (or auto), or "
                             "runtime.mode: sync (docs/vllm.md)")
        if r3 and cpu:
            raise ValueError("r3 with rollout.engine: vllm needs a GPU: vLLM's --enable-return-routed-experts runs a "
                             "Triton model runner, which the CPU build (vllm-cpu) lacks; on CPU use rollout.engine: "
                             "sglang or embedded for R3 (docs/vllm.md)")
        if release_memory and cpu:
            raise ValueError("rollout.release_memory with rollout.engine: vllm needs a GPU (vLLM's sleep mode); "
                             "the CPU build has none")
