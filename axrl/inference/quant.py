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

`rollout.precision: fp8_w8a8` is the production W8A8 recipe (DeepSeek-V3's, what SGLang's
``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul`` and vLLM's ``Fp8LinearMethod`` with
``weight_block_size: [128, 128]`` run): the block-fp8 weights above, and every activation that
enters one of those linear layers quantised dynamically to e4m3 with one fp32 scale per token and
group of 128 input channels (``scale = max(amax, 1e-10) / 448``, computed on the fly from the
activation itself). The fp8 GEMM multiplies e4m3 × e4m3 and applies both scales to its fp32
accumulator; on CPU the engine computes the same products as ``dequant(x_q) @ dequant(w_q).T``:
`fp8_round_act` (quantise → dequantise) is applied to the input of each quantised linear layer by
the fused decoder (`axrl.inference.embedded.decode`), the only forward the engine and replay's engine path
use. The router and lm_head inputs are not quantised (their weights are not either).

`rollout.kv_dtype: fp8` rounds every key and value written to the KV cache through e4m3 with one
scale per token and head (amax over the head dimension / 448). The cache keeps the rounded values
in the model's dtype, so the prefix cache, which copies cached K/V, and the teacher-forced engine
path of replay/explain, which writes through the same cache, see exactly the engine's values.
"""

from __future__ import annotations

import re
from typing import Callable, Literal, Mapping

import torch
import torch.nn.functional as F

WeightDtype = Literal["fp32", "bf16", "fp8"]
KVDtype = Literal["auto", "fp8"]
Precision = Literal["auto", "fp8_w8a8"]
WEIGHT_DTYPES = ("fp32", "bf16", "fp8")
KV_DTYPES = ("auto", "fp8")
PRECISIONS = ("auto", "fp8_w8a8")

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = 128
ACT_GROUP = 128    # input channels per activation scale (SGLang/vLLM group_size for block-fp8)
ACT_EPS = 1e-10    # floor of a group's amax, as in SGLang's and vLLM's per-token-group quantisers
# The attribute `apply_rollout_precision` sets on an engine model whose linear inputs are fp8.
ACT_ATTR = "axrl_fp8_activations"

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


def quantise_act_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `x` [..., C] → (e4m3 [..., C], fp32 scales [..., ceil(C/group)]): one dynamic
    scale per token and group of `group` channels, ``scale = max(amax, 1e-10) / 448``, ``q =
    clamp(x / scale)`` cast round-to-nearest-even (a last, shorter group is scaled on its own)."""
    C = x.shape[-1]
    ng = -(-C // group)
    xf = x.float()
    if ng * group != C:
        xf = F.pad(xf, (0, ng * group - C))  # zeros do not change a group's amax
    g = xf.reshape(*x.shape[:-1], ng, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_EPS) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*x.shape[:-1], ng * group)[..., :C], scale.squeeze(-1)


def fp8_round_act(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """`x` as a W8A8 fp8 GEMM sees it: `quantise_act_fp8` then back (``q * scale``) in x's dtype."""
    C = x.shape[-1]
    q, scale = quantise_act_fp8(x, group)
    ng = scale.shape[-1]
    if ng * group != C:
        q = F.pad(q.float(), (0, ng * group - C))
    deq = q.float().reshape(*x.shape[:-1], ng, group) * scale.unsqueeze(-1)
    return deq.view(*x.shape[:-1], ng * group)[..., :C].to(x.dtype)


def rollout_weight(w: torch.Tensor, weight_dtype: WeightDtype) -> torch.Tensor:
    """`w` as the engine computes with it under `weight_dtype` (a new tensor; `w` untouched)."""
    if weight_dtype == "fp8":
        q, scale = quantise_fp8(w)
        return dequantise_fp8(q, scale, w.dtype)
    if weight_dtype == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    return w


def effective_weight_dtype(weight_dtype: WeightDtype, precision: Precision) -> WeightDtype:
    """The weights' precision under `rollout.precision` (fp8_w8a8 implies block-fp8 weights)."""
    return "fp8" if precision == "fp8_w8a8" else weight_dtype


def check_weight_dtype(weight_dtype: str, kv_dtype: str = "auto", precision: str = "auto") -> None:
    """ValueError naming the key when a precision is not one the engine knows or they conflict."""
    if precision not in PRECISIONS:
        raise ValueError(f"rollout.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8_w8a8" and weight_dtype not in ("fp32", "fp8"):
        raise ValueError(f"rollout.precision: fp8_w8a8 holds the weights in block fp8; rollout.weight_dtype: "
                         f"{weight_dtype} contradicts it (leave weight_dtype at fp32 or set it to fp8)")
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


def activation_rounding(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the fused decoder applies to each quantised linear layer's input for `model`:
    `fp8_round_act` on a model marked W8A8 by `apply_rollout_precision`, else None (unchanged)."""
    return fp8_round_act if getattr(model, ACT_ATTR, False) else None


@torch.no_grad()
def apply_rollout_precision(model: torch.nn.Module, weight_dtype: WeightDtype,
                            precision: Precision = "auto") -> torch.nn.Module:
    """Round `model`'s quantised weights to the rollout's precision in place and mark whether its
    linear inputs are fp8 (`activation_rounding`); returns `model`. The one place the engine,
    replay's rollout re-run and its teacher-forced engine path get their precision from."""
    check_weight_dtype(weight_dtype, "auto", precision)
    weight_dtype = effective_weight_dtype(weight_dtype, precision)
    setattr(model, ACT_ATTR, precision == "fp8_w8a8")
    if weight_dtype != "fp32":
        for name, p in model.named_parameters():
            if is_quantised(name):
                p.copy_(rollout_weight(p.detach(), weight_dtype))
    return model
