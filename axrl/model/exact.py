"""Batch- and position-invariant ops: the op set of `rollout.exact: true` (true on-policy).

A token's result here depends only on the token's own inputs (its row, its keys and values), not on
how many other tokens share the call, where the token sits in it, or whether it runs in a decode
step against the KV cache or in a teacher-forced pass. The model (`axrl.model.qwen3`) switches to
these ops with `set_exact(model, True)`; the embedded engine (its fused decoder runs them:
`axrl/inference/embedded/exact_layers.py`) and the torch trainer then compute bitwise-equal logits and MoE routings for the same tokens.

Why each op is what it is (measured on torch 2.13 CPU, one thread, fp32 and bf16):

* Linear layers: a GEMM's row results change with the number of rows at small M (fp32: M = 1-3
  take GEMV / small-M kernels; from 4 rows on every row's result was the same for any M and any
  place in the call, for all of tiny-moe's shapes), so a call with fewer rows is zero-padded up
  to the measured `gemm_min_rows`. Where no such M exists the fallback feeds rows in fixed
  [ROW_CHUNK, in] GEMMs (a fixed-shape GEMM gives each row the same result wherever it sits).
* SiLU: fp32 `F.silu` computes the tail of a tensor (numel mod the SIMD width) with a scalar
  formula that rounds differently; `x / (1 + exp(-x))` is invariant (exp's scalar and vector paths
  agree, division is exactly rounded).
* Attention: the key reductions must not depend on how many keys follow a query's own position
  (decode sees `kv_len` keys, a teacher-forced pass the whole sequence). Scores are one GEMM per
  (sequence, head group) over whole blocks of `KEY_BLOCK` keys from column 0, with at least
  `SCORE_MIN_ROWS` query rows (the reduction is over head_dim, fixed; entries measured invariant
  to the row and key counts); the max is exact in any order; probs @ V is one `embedding_bag` sum
  per query over its keys in order (V read in place from the KV cache) and the denominator is
  `cumsum`'s last entry: both add the keys one by one from column 0, so the trailing masked keys
  add exact zeros. Masked keys weigh exactly 0 on both sides, so left padding, later keys and
  other prefix-tree branches change nothing.
* RMSNorm, softmax / top-k over experts, log-softmax, embedding and RoPE are row-local in torch's
  CPU kernels already (checked the same way); the MoE combine adds a token's experts in ascending
  expert order (`index_add_` per expert) in both users.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM call. Any fixed size works for invariance; 16 keeps the zero-padding waste of a
# decode step small while the teacher-forced pass still gets real GEMMs.
ROW_CHUNK = 16
# Queries per attention block in a teacher-forced pass: bounds the [queries, keys, head_dim]
# temporaries (they are freed after each block, also under autograd).
QUERY_BLOCK = 32
# The score GEMM reads keys in whole blocks of this many from column 0 (see `_attention_block`).
KEY_BLOCK = 32
# Query rows from which the score GEMM's entries are row-count invariant (1-3 rows take other kernels).
SCORE_MIN_ROWS = 4


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with every row's result independent of the other rows.

    When this machine's GEMM gives row-invariant results from `min_rows` rows on (`gemm_min_rows`,
    measured once per shape), a call with fewer rows is zero-padded to `min_rows`; otherwise every
    row goes through [ROW_CHUNK, in] GEMMs."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    min_rows = gemm_min_rows(d, weight.shape[0], weight.dtype, torch.get_num_threads())
    if min_rows:
        if n >= min_rows:
            return F.linear(x, weight, bias)
        out = F.linear(torch.cat([rows, rows.new_zeros(min_rows - n, d)]), weight, bias)[:n]
        return out.reshape(*lead, weight.shape[0])
    pad = (-n) % ROW_CHUNK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, d)])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(ROW_CHUNK)])
    return out[:n].reshape(*lead, weight.shape[0])


@functools.lru_cache(maxsize=None)
def gemm_min_rows(d_in: int, d_out: int, dtype: torch.dtype, threads: int) -> int:
    """The smallest row count m ≤ 8 from which `F.linear`'s row results no longer depend on the
    number of rows or a row's place, measured here on random data for this shape, dtype and
    thread count (CPU BLAS takes GEMV or small-M kernels below it: rows 1-3 differ in fp32 on the
    machine this was written on); 0 when none is (then `exact_linear` uses fixed-size chunks)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=g).to(dtype)
    x = torch.randn(160, d_in, generator=g).to(dtype)
    with torch.no_grad():
        ref = F.linear(x, w)
        for m in range(1, 9):
            counts = [*range(m, 20), 31, 32, 33, 64, 97, 160]
            if all(torch.equal(F.linear(x[s:s + n], w), ref[s:s + n]) for n in counts for s in (0, 160 - n)):
                return m
    return 0


@functools.lru_cache(maxsize=None)
def fused_gemm_matches(d_in: int, d_outs: tuple[int, ...], experts: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether a fused form of `exact_linear` gives every row bitwise the per-weight result, for
    every row count from `gemm_min_rows` on (measured here on random data, like `gemm_min_rows`):

    * experts == 0: one F.linear over the weights of widths `d_outs` concatenated (q/k/v, gate/up);
    * experts > 0: torch.bmm of [experts, rows, d_in] by stacked [experts, d_in, d_outs[0]]
      (contiguous), i.e. every expert's rows zero-padded to one count, in one call.

    The embedded engine's exact decoder uses the fused form only where this holds (it does for
    tiny-moe's fp32 shapes on the machine this was written on; not for bf16's batched GEMM)."""
    min_rows = gemm_min_rows(d_in, sum(d_outs), dtype, threads)
    if not min_rows or any(gemm_min_rows(d_in, d, dtype, threads) != min_rows for d in d_outs):
        return False
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(d, d_in, generator=g).to(dtype) for d in d_outs]
    stacked = torch.stack([ws[0]] * max(experts, 1)).transpose(1, 2).contiguous()
    with torch.no_grad():
        for n in (min_rows, min_rows + 1, 7, 13, 16, 31, 32, 33, 64, 100):
            n = max(n, min_rows)
            x = torch.randn(max(experts, 1), n, d_in, generator=g).to(dtype)
            if experts:
                out = torch.bmm(x, stacked)
                if not all(torch.equal(out[e], F.linear(x[e], ws[0])) for e in range(experts)):
                    return False
            else:
                out = F.linear(x[0], torch.cat(ws)).split(list(d_outs), dim=1)
                if not all(torch.equal(o, F.linear(x[0], w)) for o, w in zip(out, ws)):
                    return False
    return True


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU whose value for an element does not depend on where it sits in the tensor. Under
    autograd its gradient is torch's fused SiLU backward (see `_ExactSiLU`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _ExactSiLU.apply(x)
    return x / (1 + torch.exp(-x))


class _ExactSiLU(torch.autograd.Function):
    """`exact_silu`'s value; its gradient from `aten.silu_backward` (one op, not the four of
    autograd through x / (1 + exp(-x))). Only the forward values must be invariant: nothing
    compares gradients with the engine, and this one is as deterministic."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x / (1 + torch.exp(-x))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, own: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, H, S, D] over k, v [B, KV, K, D] (KV divides H: grouped-query attention,
    the H // KV query heads of a KV head are query rows of one attention, no K/V copies) under the
    mask [B, 1|H, S, K] (bool, or float: 0 visible, -inf hidden); each query's last visible key must
    be its own position (causal, as in every caller). `own` [B, 1|H, S]: that column, when the caller knows it (else read off the mask).
    Computed in fp32, returned in q's dtype [B, H, S, D]. See the module docstring."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _ExactAttention.apply(q, k, v, mask, own, scale)
    return _exact_attention(q, k, v, mask, scale, own)


class _ExactAttention(torch.autograd.Function):
    """`exact_attention`'s value (computed without a graph); its gradient is that of the same
    attention through torch's SDPA, recomputed in the backward. Autograd through the blocked form
    would record every block's small ops (the exact train step cost ~1.6x the normal one that way);
    the gradient needs no invariance, only to be the attention's and deterministic."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor, own: torch.Tensor | None, scale: float) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _exact_attention(q, k, v, mask, scale, own)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=ctx.scale,
                                                 enable_gqa=kf.shape[1] != qf.shape[1])
            gq, gk, gv = torch.autograd.grad(out, (qf, kf, vf), grad.float())
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     own: torch.Tensor | None) -> torch.Tensor:
    """`exact_attention` itself (the forward's values; no graph needed)."""
    B, H, S, D = q.shape
    KV, K = k.shape[1], mask.shape[-1]
    if own is None:
        visible = mask == 0 if mask.is_floating_point() else mask
        own = K - 1 - visible.flip(-1).to(torch.int8).argmax(-1)                       # [B, 1|H, S]
    if KV != H:  # rows r*S + i of group g: query head g*rep + r at position i
        rep = H // KV
        q = q.reshape(B, KV, rep * S, D)
        # one query per head (a decode step): its mask row and own column broadcast over the rows
        if S > 1 or mask.shape[1] > 1 or own.shape[1] > 1:
            mask, own = _group_rows(mask, B, KV, rep), _group_rows(own, B, KV, rep)
    # whole key blocks from column 0 (padded keys are masked), K in fp32 once for all query blocks;
    # V as rows of an embedding table (the KV cache's own storage when it is one: no copy)
    width = -(-K // KEY_BLOCK) * KEY_BLOCK
    hidden = float("-inf") if mask.is_floating_point() else 0.0
    k, mask = _to_width(k.float(), width, dim=2), _to_width(mask, width, dim=-1, fill=hidden)
    table, strides = _row_table(v, width)
    rows = q.shape[2]
    out = [_attention_block(q[:, :, s:s + QUERY_BLOCK], k, table, strides, mask[:, :, s:s + QUERY_BLOCK],
                            own[:, :, s:s + QUERY_BLOCK], scale) for s in range(0, rows, QUERY_BLOCK)]
    out = out[0] if len(out) == 1 else torch.cat(out, dim=2)
    return out.reshape(B, H, S, D).to(q.dtype)


def _group_rows(t: torch.Tensor, B: int, KV: int, rep: int) -> torch.Tensor:
    """A per-head [B, 1|H, S, ...] tensor in the grouped layout [B, 1|KV, rep * S, ...]."""
    if t.shape[1] == 1:
        return t.unsqueeze(2).expand(B, 1, rep, *t.shape[2:]).reshape(B, 1, rep * t.shape[2], *t.shape[3:])
    return t.reshape(B, KV, rep * t.shape[2], *t.shape[3:])


def _row_table(v: torch.Tensor, width: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """V [B, KV, K, D] as an fp32 table [rows, D] and (b_stride, g_stride): key j of (b, g) is row
    b * b_stride + g * g_stride + j, for j < width. A view of v's own storage when v is fp32 with
    rows of D contiguous values (a KV cache slice), else a padded fp32 copy."""
    B, KV, K, D = v.shape
    strides = [v.stride(i) for i, n in enumerate(v.shape[:2]) if n > 1]
    if (v.dtype != torch.float32 or K < width or v.stride(-1) != 1 or (K > 1 and v.stride(2) != D)
            or any(st % D for st in strides)):
        v = _to_width(v.float(), width, dim=2).contiguous()
    s0 = v.stride(0) // D if B > 1 else 0
    s1 = v.stride(1) // D if KV > 1 else 0
    return v.as_strided(((B - 1) * s0 + (KV - 1) * s1 + width, D), (D, 1)), (s0, s1)


def _attention_block(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, strides: tuple[int, int],
                     mask: torch.Tensor, own: torch.Tensor, scale: float) -> torch.Tensor:
    qf = q.float()
    B, G, s = qf.shape[:3]
    # Whole key blocks from column 0 up to the block of the last own column among these queries:
    # later keys are masked for all of them and would add exact zeros (see `_weighted_rows`).
    width = (int(own.max()) // KEY_BLOCK + 1) * KEY_BLOCK
    mask, kf = mask.narrow(-1, 0, width), k.narrow(2, 0, width)
    # Scores as one GEMM per (sequence, head group): entry (i, j) depended neither on the number of
    # query rows from SCORE_MIN_ROWS on nor on the key count in whole blocks (measured, fp32 and
    # bf16); fewer query rows (a decode step) are zero-padded up to it.
    if s < SCORE_MIN_ROWS:
        qf = F.pad(qf, (0, 0, 0, SCORE_MIN_ROWS - s))
    raw = qf @ kf.transpose(-1, -2)
    scores = raw.mul_(scale) if raw.shape[2] == s else raw[:, :, :s] * scale            # [B, G, s, W]
    # an additive mask (0 / -inf) adds exact zeros to the visible keys: the same values
    # (in place: `scores` is this block's own tensor; fresh big temporaries cost page faults)
    scores = scores.add_(mask) if mask.is_floating_point() else scores.masked_fill_(~mask, float("-inf"))
    e = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # max: exact in any order; masked keys: 0
    return _weighted_rows(e, table, strides)


def _weighted_rows(e: torch.Tensor, table: torch.Tensor, strides: tuple[int, int]) -> torch.Tensor:
    """Σ_j e[..., j] · V[j] / Σ_j e[..., j] per query row of e [B, G, s, W], each sum in key order
    0..W-1 whatever W and the call's other queries (the keys past a query's own column weigh
    exactly 0, so W changes nothing): the numerator as `embedding_bag` sums, one bag per query
    (the bag kernel adds a bag's rows in index order into one accumulator per column: measured
    invariant to trailing zero weights and to the number of bags, fp32 and bf16 tables), the
    denominator as `cumsum`'s last entry (a sequential float64 accumulator on CPU)."""
    B, G, s, W = e.shape
    num = F.embedding_bag(_bag_rows(B, G, *strides, s, W, e.device), table, mode="sum",
                          per_sample_weights=e.reshape(-1, W))
    return num.view(B, G, s, -1).div_(e.cumsum(-1)[..., -1:])


def _bag_rows(B: int, G: int, b_stride: int, g_stride: int, s: int, W: int, device: torch.device) -> torch.Tensor:
    """The bags' table rows [B * G * s, W] of `_weighted_rows` (see `_row_table`). Small ones are
    cached: a decode step's layers, and the next steps until a key block fills, read the same rows."""
    if B * G * s * W <= 1 << 18:
        return _bag_rows_cached(B, G, b_stride, g_stride, s, W, device)
    return _make_bag_rows(B, G, b_stride, g_stride, s, W, device)


def _make_bag_rows(B: int, G: int, b_stride: int, g_stride: int, s: int, W: int, device: torch.device) -> torch.Tensor:
    base = torch.arange(B, device=device)[:, None] * b_stride + torch.arange(G, device=device) * g_stride
    return (base[:, :, None, None] + torch.arange(W, device=device)).expand(B, G, s, W).reshape(-1, W)


_bag_rows_cached = functools.lru_cache(maxsize=16)(_make_bag_rows)


def _to_width(t: torch.Tensor, width: int, dim: int, fill: float = 0.0) -> torch.Tensor:
    """`t` cut or padded with `fill` (zero / False by default) to `width` entries along `dim` (-1 or 2)."""
    size = t.shape[dim]
    if size >= width:
        return t.narrow(dim, 0, width)
    return F.pad(t, (0, width - size) if dim == -1 else (0, 0, 0, width - size), value=fill)


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
