"""Per-tensor checksums of model weights, computed where the tensors live (the trainer's posted
copy, the embedded engine's parameters, a server's worker through an extension) and compared by
HF name.

A checksum is two numbers, both deterministic:

* `digest` — exact: the CRC-32 of the tensor's raw bytes (zlib, hardware-accelerated; read in
  place for a CPU tensor, copied to the host in chunks of `CHUNK` bytes from a device) and its
  element count. Two copies with the same bits always have equal digests; a changed tensor goes
  unnoticed with probability 2**-32 (a guard against stale, skipped or half-done loads, not
  against an adversary).
* `sample_sum` — informative: the fp64 sum of a fixed strided sample of at most `SAMPLE` elements,
  which says by how much a mismatching tensor differs (a digest says only *that* it differs).

Cost: one pass over the bytes, no copy of a CPU model: tiny-moe's 8 MB take 3 ms of CRC and
~50 ms in all (135 tensors) on one CPU thread (`bench/sentinel_cost.py` measures it in a run).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

SAMPLE = 1024          # elements in the strided sample of `sample_sum`
CHUNK = 1 << 26        # bytes per host read of a device tensor (bounds the host copy)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorChecksum:
    """The checksum of one tensor: the exact `digest` ("CRC-32 of its bytes:element count") and
    the fp64 `sample_sum` of its strided sample."""

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


@dataclass(frozen=True)
class ChecksumPair:
    """What the sentinel compares for one engine: `expected` (the trainer's posted weights as the
    engine should hold them, by name) and `held` (what the engine holds, by the same names), plus
    the HF tensors the engine keeps in a form no checksum can read (`unreadable`: an opaque kernel
    handle), which are left to the probe."""

    expected: dict[str, TensorChecksum]
    held: dict[str, TensorChecksum]
    unreadable: tuple[str, ...] = ()


def tensor_location(name: str) -> tuple[int | None, int | None]:
    """(layer, expert) decoded from an HF key: `model.layers.3.mlp.experts.5.up_proj.weight` →
    (3, 5); a layer's non-expert weight → (layer, None); embeddings, final norm, lm_head → (None, None)."""
    layer, expert = _LAYER.search(name), _EXPERT.search(name)
    return (None if layer is None else int(layer.group(1)), None if expert is None else int(expert.group(1)))


def tensor_checksum(t: torch.Tensor) -> TensorChecksum:
    """The checksum of `t` (see the module docstring)."""
    flat = t.detach().contiguous().reshape(-1)   # weights need no grad: detach, no no_grad context
    n = flat.numel()
    if n == 0:
        return TensorChecksum("00000000:0", 0.0, 0)
    stride = max(1, n // SAMPLE)
    sample_sum = float(flat[::stride][:SAMPLE].to(torch.float64).sum().item())
    raw = flat.view(torch.uint8)
    crc = 0
    for start in range(0, raw.numel(), CHUNK):
        piece = raw[start:start + CHUNK]
        crc = zlib.crc32(memoryview(piece.numpy() if piece.device.type == "cpu" else piece.cpu().numpy()), crc)
    return TensorChecksum(f"{crc:08x}:{n}", sample_sum, n)


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
    return TensorMismatch(name, layer, expert, _known(want), _known(got))


def _known(c: TensorChecksum | None) -> float | None:
    """A checksum's sample sum, None where it has none (NaN: a server's hash gives none)."""
    return None if c is None or c.sample_sum != c.sample_sum else c.sample_sum
