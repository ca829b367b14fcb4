"""A cheap, deterministic digest of a set of named tensors (the trace's weights fingerprint)."""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch


def weights_fingerprint(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Hex blake2b-128 over (name, dtype, shape, raw bytes) in sorted name order.

    Equal iff the tensors are bitwise equal under the same names, dtypes and shapes (+0.0 vs
    -0.0 and different NaN payloads count as different, as they should for replay). Sorting makes
    it independent of iteration order, so two backends using HF names give comparable digests.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(items, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        # View as bytes so dtypes numpy lacks (bfloat16) hash without conversion or copies.
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
