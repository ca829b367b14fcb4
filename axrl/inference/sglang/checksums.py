"""The sync sentinel's checksums of an SGLang server: SGLang's own per-tensor checker
(`weight_checksums.held_checksums`, `POST /weights_checker`) paired with the trainer's posted
weights laid out and hashed as SGLang holds them (`weight_checksums.expected_checksums`), by
SGLang's tensor names (`axrl.sync.engine_side.ServerSide` calls this)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from axrl.inference.sglang.weight_checksums import expected_checksums, held_checksums
from axrl.sync.checksums import ChecksumPair, TensorChecksum

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _server_dtype(url: str) -> tuple[torch.dtype, str]:
    """(dtype, device) the server computes in, from its `/server_info` (`--dtype auto` serves an
    fp32 checkpoint in float16, so the launch flags alone do not say)."""
    import httpx

    try:
        info = httpx.get(url.rstrip("/") + "/server_info", timeout=30).json()
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"{url}/server_info: {type(e).__name__}: {e}") from None
    dtype = str(info.get("dtype", "")).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise RuntimeError(f"{url}/server_info: dtype {info.get('dtype')!r} is not one the checksums model")
    device = "cuda" if str(info.get("device", "cpu")).startswith("cuda") else "cpu"
    return _DTYPES[dtype], device


def _as_checksum(digest: str) -> TensorChecksum:
    # SGLang's hash says only whether bytes differ: no sample sum, no element count
    return TensorChecksum(digest, math.nan, 0)


def sglang_checksum_pair(engine: Any, server: int, weights: Mapping[str, torch.Tensor]) -> ChecksumPair:
    """The checksums of `weights` as SGLang server `server` of `engine` should hold them, and of
    what it holds, by SGLang name; RuntimeError when the server cannot answer."""
    url = engine.urls[server]
    dtype, device = _server_dtype(url)
    held = held_checksums(url)
    want = expected_checksums(weights, dtype, server_device=device)
    expected = {name: _as_checksum(t.digest) for name, t in want.items()}
    if "lm_head.weight" not in held:      # tied embeddings: the server holds the embedding once
        expected.pop("lm_head.weight", None)
    # buffers and anything the layout table does not model are not compared
    return ChecksumPair(expected, {k: _as_checksum(v) for k, v in held.items() if k in expected})
