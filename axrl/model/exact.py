"""Batch- and position-invariant ops: the op set of `rollout.exact: true` (true on-policy).

A token's result here depends only on the token's own inputs (its row, its keys and values), not on
how many other tokens share the call, where the token sits in it, or whether it runs in a decode
step against the KV cache or in a teacher-forced pass. The model (`axrl.model.qwen3`) switches to
these ops with `set_exact(model, True)`; the embedded engine (through the model's own forward) and
the torch trainer then compute bitwise-equal logits and MoE routings for the same tokens.

Why each op is what it is (measured on torch 2.13 CPU, one thread, fp32 and bf16):

* Linear layers: a GEMM's row results change with the number of rows (M = 1 takes a GEMV kernel,
  other M other blockings), but a GEMM of a *fixed* shape gives each row the same result whatever
  the other rows are and wherever the row sits. So rows are fed in chunks of `ROW_CHUNK`, the last
  chunk zero-padded: every call the kernel sees is [ROW_CHUNK, in] × [in, out].
* SiLU: fp32 `F.silu` computes the tail of a tensor (numel mod the SIMD width) with a scalar
  formula that rounds differently; `x / (1 + exp(-x))` is invariant (exp's scalar and vector paths
  agree, division is exactly rounded).
* Attention: the key reduction must not depend on how many keys follow a query's own position
  (decode sees `kv_len` keys, a teacher-forced pass the whole sequence). Scores are per-key dot
  products (multiply, then a sum over head_dim: a fixed-length reduction); the max is exact in any
  order; the softmax denominator and the value sum are sequential `cumsum`s over the keys, read at
  the query's own column. Masked keys weigh exactly 0 and adding 0 is exact, so left padding,
  later keys and other prefix-tree branches change nothing.
* RMSNorm, softmax / top-k over experts, log-softmax, embedding and RoPE are row-local in torch's
  CPU kernels already (checked the same way); the MoE combine adds a token's experts in ascending
  expert order (`index_add_` per expert) in both users.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM call. Any fixed size works for invariance; 16 keeps the zero-padding waste of a
# decode step small while the teacher-forced pass still gets real GEMMs.
ROW_CHUNK = 16
# Queries per attention block in a teacher-forced pass: bounds the [queries, keys, head_dim]
# temporaries (they are freed after each block, also under autograd).
QUERY_BLOCK = 32


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with every row computed by a [ROW_CHUNK, in] GEMM."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    pad = (-n) % ROW_CHUNK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, d)])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(ROW_CHUNK)])
    return out[:n].reshape(*lead, weight.shape[0])


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU whose value for an element does not depend on where it sits in the tensor."""
    return x / (1 + torch.exp(-x))


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of q [B, H, S, D] over k, v [B, H, K, D] (heads already matched) under the bool
    mask [B, 1|H, S, K]; each query's last visible key must be its own position (causal, as in
    every caller). Computed in fp32, returned in q's dtype. See the module docstring."""
    out = [_attention_block(q[:, :, s:s + QUERY_BLOCK], k, v, mask[:, :, s:s + QUERY_BLOCK], scale)
           for s in range(0, q.shape[2], QUERY_BLOCK)]
    return (out[0] if len(out) == 1 else torch.cat(out, dim=2)).to(q.dtype)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = (qf.unsqueeze(3) * kf.unsqueeze(2)).sum(-1) * scale            # [B, H, s, K]
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)                                      # exact in any order
    e = torch.exp(scores - top)                                              # masked keys: exactly 0
    K = mask.shape[-1]
    # The query's own column: its last visible key.
    own = (K - 1 - mask.flip(-1).to(torch.int8).argmax(-1)).expand(*e.shape[:-1])   # [B, H, s]
    den = e.cumsum(-1).gather(-1, own[..., None])                            # [B, H, s, 1]
    num = (e.unsqueeze(-1) * vf.unsqueeze(2)).cumsum(3)                      # [B, H, s, K, D]
    num = num.gather(3, own[..., None, None].expand(*own.shape, 1, vf.shape[-1]))[:, :, :, 0]
    return num / den


def set_exact(model: nn.Module, on: bool) -> nn.Module:
    """Switch every submodule of `model` that has an exact variant (`exact` attribute) to it, or
    back; returns the model."""
    for module in model.modules():
        if hasattr(module, "exact"):
            module.exact = on
    return model


def is_exact(model: nn.Module) -> bool:
    """Whether `model` runs the exact op set."""
    return bool(getattr(model, "exact", False))
