"""The sync sentinel's checksums of a vLLM server: the worker extension's per-tensor checksums
(`checksum_extension`, through `POST /collective_rpc`) paired with the trainer's posted weights
in the server's dtype, by HF name (`axrl.sync.engine_side.ServerSide` calls this)."""

from __future__ import annotations

import json
from typing import Any, Mapping

import torch

from axrl.sync.checksums import ChecksumPair, TensorChecksum, state_checksums

METHOD = "axrl_weight_checksums"


def _parse(raw: Any, url: str) -> dict[str, Any]:
    results = raw.get("results") if isinstance(raw, dict) else None
    if not results or not isinstance(results[0], str):
        raise RuntimeError(f"{url}: /collective_rpc {METHOD} answered {str(raw)[:200]!r} (was the server started "
                           "with AxRL's worker extension? only servers AxRL launches have it)")
    return json.loads(results[0])     # one worker per CPU server; tensor parallel is not read here


def vllm_checksum_pair(engine: Any, server: int, weights: Mapping[str, torch.Tensor]) -> ChecksumPair:
    """The checksums of `weights` as vLLM server `server` of `engine` (a `VLLMEngine`) should hold
    them, and of what it holds; RuntimeError when the server cannot answer (no extension)."""
    url = engine.urls[server]
    path = engine.weights_dir
    if path is None:
        raise RuntimeError(f"{url}: no exported weights directory to compare with")
    try:
        got = _parse(engine.worker_call(server, METHOD, str(path.resolve())), url)
    except ValueError as e:          # the route refused: no such method on the worker
        raise RuntimeError(f"{url}: {e}") from None
    held = {k: TensorChecksum(*v) for k, v in got["held"].items()}
    derived = {k: TensorChecksum(*v) for k, v in got["expected"].items()}
    unreadable = tuple(got["unreadable"])
    skip = set(unreadable) | {s for sources in got["packed"].values() for s in sources}   # compared in the worker
    dtype = getattr(torch, str(got.get("dtype", "float32")).removeprefix("torch."))
    expected = state_checksums({k: v.detach().to(dtype) for k, v in weights.items() if k not in skip})
    expected.update(derived)
    return ChecksumPair(expected, held, unreadable)
