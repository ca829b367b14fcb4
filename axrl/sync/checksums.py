"""Per-tensor checksums of model weights, computed where the tensors live (the trainer's posted
copy, the embedded engine's parameters, a server's worker through an extension) and compared by
HF name.

A checksum is two numbers, both deterministic on any device and in any reduction order:

* `digest` — exact: the tensor's raw bits read as integers of its item width (int32 for fp32,
  int16 for bf16/fp16, int8 for fp8), summed twice in int64 (plain, and weighted by the element's
  position + 1), both wrapping modulo 2**64. Integer sums do not depend on the order of the
  reduction, so two copies with the same bits always have equal digests, and a changed tensor
  goes unnoticed only if both sums collide (changes that cancel in the plain sum and, weighted by
  their positions, in the other too).
* `sample_sum` — informative: the fp64 sum of a fixed strided sample of at most `SAMPLE` elements,
  which says by how much a mismatching tensor differs (a digest says only *that* it differs).

Cost: one pass over the weights' bits in chunks of `CHUNK` elements (a few int64 temporaries of
that size, never a copy of the whole model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

SAMPLE = 1024          # elements in the strided sample of `sample_sum`
CHUNK = 1 << 22        # elements per integer pass (bounds the temporaries)
_MASK = (1 << 64) - 1
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorChecksum:
    """The checksum of one tensor: the exact `digest` (two wrapped int64 sums of its bits, as one
    hex string) and the fp64 `sample_sum` of its strided sample."""

    digest: str
    sample_sum: float
    numel: int

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "sample_sum": self.sample_sum, "numel": self.numel}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorChecksum":
        return cls(str(d["digest"]), float(d["sample_sum"]), int(d["numel"]))


@dataclass(frozen=True)
class TensorMismatch:
    """One tensor whose checksums differ (or that one side lacks), located by its HF name."""

    name: str
    layer: int | None
    expert: int | None
    expected_sample_sum: float | None
    held_sample_sum: float | None

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.name, "layer": self.layer, "expert": self.expert,
                "expected_sample_sum": self.expected_sample_sum, "held_sample_sum": self.held_sample_sum}


def tensor_location(name: str) -> tuple[int | None, int | None]:
    """(layer, expert) decoded from an HF key: `model.layers.3.mlp.experts.5.up_proj.weight` →
    (3, 5); a layer's non-expert weight → (layer, None); embeddings, final norm, lm_head → (None, None)."""
    layer, expert = _LAYER.search(name), _EXPERT.search(name)
    return (None if layer is None else int(layer.group(1)), None if expert is None else int(expert.group(1)))


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> TensorChecksum:
    """The checksum of `t`, computed on its own device (see the module docstring)."""
    flat = t.detach().contiguous().reshape(-1)
    n = flat.numel()
    if n == 0:
        return TensorChecksum("0" * 32, 0.0, 0)
    stride = max(1, n // SAMPLE)
    sample_sum = float(flat[::stride][:SAMPLE].to(torch.float64).sum().item())
    bits = flat.view(_INT_OF_WIDTH[flat.element_size()])
    plain = weighted = 0
    for start in range(0, n, CHUNK):
        chunk = bits[start:start + CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
        plain = (plain + int(chunk.sum().item())) & _MASK
        weighted = (weighted + int((chunk * pos).sum().item())) & _MASK
    return TensorChecksum(f"{plain:016x}{weighted:016x}", sample_sum, n)


def state_checksums(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> dict[str, TensorChecksum]:
    """`tensor_checksum` of every named tensor (a state dict or `(name, tensor)` pairs)."""
    items = named.items() if isinstance(named, Mapping) else named
    return {name: tensor_checksum(t) for name, t in items}


def compare_checksums(expected: Mapping[str, TensorChecksum],
                      held: Mapping[str, TensorChecksum]) -> list[TensorMismatch]:
    """The tensors whose digests differ, or that only one side has, in `expected`'s order (then
    the engine's extras); a tied `lm_head.weight` that only one side lists is not a mismatch."""
    out = []
    for name, want in expected.items():
        got = held.get(name)
        if got is None or got.digest != want.digest:
            out.append(_mismatch(name, want, got))
    for name, got in held.items():
        if name not in expected and name != "lm_head.weight":
            out.append(_mismatch(name, None, got))
    return out


def _mismatch(name: str, want: TensorChecksum | None, got: TensorChecksum | None) -> TensorMismatch:
    layer, expert = tensor_location(name)
    return TensorMismatch(name, layer, expert, None if want is None else want.sample_sum,
                          None if got is None else got.sample_sum)
