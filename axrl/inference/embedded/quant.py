"""Low-precision rollout: the precision the embedded engine holds its weights and K/V in.

`rollout.weight_dtype` chooses the weights of the engine's matmuls:

- ``fp32``: the trainer's weights as they are (the model's dtype; nothing changes);
- ``bf16``: each quantised weight rounded to bfloat16;
- ``fp8``: e4m3 weights with one fp32 scale per 128×128 block (the block-fp8 layout of
  DeepSeek-V3, SGLang and vLLM: ``w ≈ q * scale``, ``scale = amax(block) / 448``).

Which weights: the linear layers of attention (q/k/v/o_proj) and of the MLPs and MoE experts
(gate/up/down_proj). Embeddings, norms, the MoE router (``mlp.gate``) and ``lm_head`` keep the
model's precision, as in the field's FP8 rollouts: the router's top-k and the vocabulary softmax
are where small errors turn into different experts and different tokens.

The quantisation runs on every weight sync (`EmbeddedEngine.update_weights`) and when an engine
is built, from the trainer's weights. CPUs have no fp8 GEMM, so the engine computes with the
dequantised weights (``q.float() * scale`` in the model's dtype), materialised once per sync: the
same values a dequantise-in-the-matmul kernel would multiply by, bit for bit, without paying the
dequantisation on every forward. (So fp8 here models the numerics of fp8 rollout, not its memory.)

`rollout.kv_dtype: fp8` rounds every key and value written to the KV cache through e4m3 with one
scale per token and head (amax over the head dimension / 448). The cache keeps the rounded values
in the model's dtype, so the prefix cache, which copies cached K/V, and the teacher-forced engine
path of replay/explain, which writes through the same cache, see exactly the engine's values.
"""

from __future__ import annotations

import re
from typing import Literal, Mapping

import torch

WeightDtype = Literal["fp32", "bf16", "fp8"]
KVDtype = Literal["auto", "fp8"]
WEIGHT_DTYPES = ("fp32", "bf16", "fp8")
KV_DTYPES = ("auto", "fp8")

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128

# Linear layers of attention, dense MLPs and MoE experts; not the router `mlp.gate`, lm_head,
# embeddings or norms.
_QUANTISED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def is_quantised(name: str) -> bool:
    """Whether the HF-named parameter `name` is held in the rollout's low precision."""
    return _QUANTISED.search(name) is not None


def quantise_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D `w` [R, C] → (e4m3 tensor [R, C], fp32 scales [ceil(R/block), ceil(C/block)]) with
    `w ≈ q * scale` per block; an all-zero block gets scale 1."""
    if w.dim() != 2:
        raise ValueError(f"quantise_fp8: expected a 2-D weight, got shape {tuple(w.shape)}")
    R, C = w.shape
    nr, nc = -(-R // block), -(-C // block)
    padded = torch.zeros(nr * block, nc * block, dtype=torch.float32, device=w.device)
    padded[:R, :C] = w.float()
    blocks = padded.view(nr, block, nc, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nr * block, nc * block)[:R, :C].contiguous(), scale


def dequantise_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block: int = BLOCK) -> torch.Tensor:
    """The weight `q * scale` (scales broadcast over their blocks) in `dtype`."""
    R, C = q.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:R, :C]
    return (q.float() * full).to(dtype)


def fp8_round_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded through e4m3 with one scale per vector along the last dimension (a K/V head
    of one token), back in x's dtype."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def rollout_weight(w: torch.Tensor, weight_dtype: WeightDtype) -> torch.Tensor:
    """`w` as the engine computes with it under `weight_dtype` (a new tensor; `w` untouched)."""
    if weight_dtype == "fp8":
        q, scale = quantise_fp8(w)
        return dequantise_fp8(q, scale, w.dtype)
    if weight_dtype == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    return w


def check_weight_dtype(weight_dtype: str, kv_dtype: str = "auto") -> None:
    """ValueError naming the key when either precision is not one the engine knows."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"rollout.weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"rollout.kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def server_quantization_args(weight_dtype: WeightDtype) -> list[str]:
    """The flags an SGLang or vLLM server needs to roll out in `weight_dtype` (both spell block-fp8
    `--quantization fp8`; GPU only, so the config refuses fp8 with a server engine on CPU)."""
    return ["--quantization", "fp8"] if weight_dtype == "fp8" else []


def rollout_state_dict(sd: Mapping[str, torch.Tensor], weight_dtype: WeightDtype) -> dict[str, torch.Tensor]:
    """`sd` with its quantised weights replaced by their rollout-precision values (others shared)."""
    if weight_dtype == "fp32":
        return dict(sd)
    return {k: rollout_weight(v, weight_dtype) if is_quantised(k) else v for k, v in sd.items()}


@torch.no_grad()
def apply_rollout_precision(model: torch.nn.Module, weight_dtype: WeightDtype) -> torch.nn.Module:
    """Round `model`'s quantised weights to `weight_dtype` in place; returns `model`."""
    if weight_dtype != "fp32":
        for name, p in model.named_parameters():
            if is_quantised(name):
                p.copy_(rollout_weight(p.detach(), weight_dtype))
    return model
