"""`VLLMEngine`: the `InferenceEngine` protocol over a vLLM server's token-in/token-out API.

It is the SGLang client (`axrl/inference/sglang/client.py`: its event loop, sticky routing,
retries, restart-and-resync, abort bookkeeping) with vLLM's routes in the places where the two
APIs differ:

- generation: one request per `POST /inference/v1/generate` (vLLM batches requests itself,
  continuously; it has no batched body), wire format in `vllm/wire.py`;
- abort: `POST /abort_requests` with vLLM's id of the request;
- weight labels: `GET /weight_info`; weight updates: `vllm/weight_updater.py` (in place, or by
  restarting the servers on the new directory: `weight_route`);
- memory: `/sleep?level=1` and `/wake_up` (GPU builds; vLLM's CPU build has no sleep mode);
- `stream=True` requests are sent whole: their tokens arrive with the result (one chunk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import httpx

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.remote.weights import ServerWeights
from axrl.inference.sglang.client import SGLangEngine
from axrl.inference.vllm.weight_updater import ROUTES, VLLMWeights
from axrl.inference.vllm.wire import WIRE_ID_PREFIX, request_to_vllm, result_from_vllm

__all__ = ["VLLMEngine"]


class VLLMEngine(SGLangEngine):
    """HTTP client for one or more vLLM servers (see the module docstring); the arguments are
    `SGLangEngine`'s (`weight_sync` must be "disk"), plus `weight_route`: "reload" (in place) or
    "restart" (the launcher restarts the servers on the new weights), and `repack_experts`: after
    an in-place reload, re-pack the experts through AxRL's worker extension (the CPU build needs
    it; `weight_updater.py`)."""

    NAME = "vllm"
    GENERATE_PATH = "/inference/v1/generate"
    INFO_PATH = "/weight_info"

    def __init__(self, urls: Sequence[str], *, weight_route: str = "reload", repack_experts: bool = False,
                 **options: Any) -> None:
        if weight_route not in ROUTES:
            raise ValueError(f"weight_route must be one of {ROUTES}, got {weight_route!r}")
        # read by _weight_updater, during the base class's set-up
        self.weight_route, self.repack_experts = weight_route, repack_experts
        super().__init__(urls, **options)

    def _weight_updater(self, **options: Any) -> ServerWeights:
        """vLLM's pause / reload_weights / resume route (`VLLMWeights`)."""
        if options["weight_sync"] != "disk":
            raise ValueError("weight_sync: vLLM servers are synced from disk only (docs/vllm.md)")
        weights = VLLMWeights(self._transport, self.launcher, version=options["version"], weight_sync="disk",
                              export_dir=self.export_dir, model_dir=self.model_dir)
        weights.route, weights.repack_experts = self.weight_route, self.repack_experts
        return weights

    @property
    def weights_dir(self) -> Path | None:
        """The HF directory the servers hold: the last one they were given, else the one the
        launcher started them on (None for servers AxRL did not launch, before any update)."""
        if self._weights.updated:
            return self._weights.last_dir
        return None if self.launcher is None else Path(self.launcher.model_path)

    def worker_call(self, server: int, method: str, *args: str) -> Any:
        """Call `method` of AxRL's worker extension (`worker_extension.py`) on server `server`'s
        workers (`POST /collective_rpc`, dev mode); vLLM's answer, `{"results": [one per worker]}`.
        ValueError when the server refuses it (a server started without the extension)."""
        return self._transport.control(server, "POST", "/collective_rpc", {"method": method, "args": list(args)}).json()

    def _model_info(self, i: int) -> dict[str, Any]:
        resp = self._transport.control(i, "GET", self.INFO_PATH, ok404=True)
        if resp.status_code == 404:
            raise ValueError(f"{self.urls[i]} has no {self.INFO_PATH}: start the vLLM server with "
                             "VLLM_SERVER_DEV_MODE=1, --enable-scale-out and --logprobs-mode processed_logprobs "
                             "(docs/vllm.md lists every flag AxRL's launcher gives it)")
        return resp.json()

    def _abort_call(self, wire_rid: str) -> tuple[str, dict[str, Any]]:
        return "/abort_requests", {"request_ids": [WIRE_ID_PREFIX + wire_rid]}

    def _split(self, server: int, ks: list[int], reqs: list[GenerateRequest]) -> list[list[int]]:
        return [[k] for k in ks]

    def _request_body(self, server: int, reqs: list[GenerateRequest], rids: list[str]) -> dict[str, Any]:
        return request_to_vllm(reqs[0], rids[0])

    def _parse(self, url: str, data: Any, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        return [result_from_vllm(data, reqs[0], current_version=self._weights.version)]

    async def _post_streaming(self, url: str, body: dict[str, Any], req: GenerateRequest) -> httpx.Response:
        return await self._http.post(url + self.GENERATE_PATH, json=body)

    def release_memory(self) -> None:
        """Every server frees its weights' and KV cache's memory (`/sleep?level=1`; GPU builds)."""
        self._transport.post_all("/sleep?level=1", {})

    def resume_memory(self) -> None:
        """Every server allocates again what `release_memory` freed (`/wake_up`)."""
        self._transport.post_all("/wake_up", {})
