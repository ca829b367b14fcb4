"""The fused decoder's layer halves under `rollout.exact: true` (true on-policy).

`FusedDecoder` (decode.py) normally computes the model's math with cheaper, differently-rounded
ops (one q/k/v GEMM, residual adds inside addmm, experts as embedding bags, SDPA). Under the exact
op set (`axrl.model.exact`) a token's result must instead be the bitwise result of the model's own
exact forward, as the torch trainer runs it: so here every GEMM is `exact_linear` on the model's
own weight (q, k and v separately, the residual added after), SiLU is `exact_silu`, attention is
`exact_attention` (grouped-query, over the KV cache's view in whole key blocks, V read in place), and the
experts run as the model's MoE block does — each expert's rows in token order, combined into a zero
tensor with `index_add_` in ascending expert order. What stays fused is everything that is
row-local and bitwise the model's: packed prompt rows, RMSNorm, the RoPE table, the K/V writes.
"""

from __future__ import annotations

from typing import Callable

import torch

from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.model.exact import (KEY_BLOCK, exact_attention, exact_linear, exact_silu, fused_gemm_matches,
                               gemm_min_rows)


class ExactLayer:
    """One decoder layer's weights as the exact ops read them: the model's own parameters, and the
    fused forms (concatenated q/k/v and gate/up, experts stacked for one batched GEMM) only where
    `fused_gemm_matches` measured them bitwise equal to the model's separate GEMMs. Copies: rebuilt
    by `FusedDecoder.repack` after the weights change."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        threads = torch.get_num_threads()
        w = attn.q_proj.weight
        d_in, dtype = w.shape[1], w.dtype
        qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        # q/k/v as one GEMM when that rounds every column as the three do; else a tuple of three
        self.qkv = (torch.cat(qkv) if fused_gemm_matches(d_in, tuple(t.shape[0] for t in qkv), 0, dtype, threads)
                    else tuple(qkv))
        self.w_o = attn.o_proj.weight
        self.batched: tuple[torch.Tensor, torch.Tensor] | None = None
        if layer.is_moe:
            self.experts = [_mlp_weights(e, threads) for e in mlp.experts]
            self.expert_ids = torch.arange(1, len(self.experts) + 1, device=w.device)
            inter, E = mlp.experts[0].gate_proj.weight.shape[0], len(self.experts)
            if (all(isinstance(e[0], torch.Tensor) for e in self.experts)
                    and fused_gemm_matches(d_in, (2 * inter,), E, dtype, threads)
                    and fused_gemm_matches(inter, (d_in,), E, dtype, threads)):
                # every expert's rows padded to one count: two batched GEMMs for the whole block
                self.batched = (torch.stack([e[0].t() for e in self.experts]).contiguous(),
                                torch.stack([e[2].t() for e in self.experts]).contiguous())
                self.min_rows = gemm_min_rows(d_in, 2 * inter, dtype, threads)
        else:
            self.mlp = _mlp_weights(mlp, threads)


def _mlp_weights(mlp: torch.nn.Module, threads: int) -> tuple:
    """(gate/up, down): gate/up one concatenated weight where measured equal, else (gate, up)."""
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    fused = fused_gemm_matches(gate.shape[1], (gate.shape[0], up.shape[0]), 0, gate.dtype, threads)
    return (torch.cat([gate, up]) if fused else (gate, up)), gate.shape[0], down


def exact_mlp(h: torch.Tensor, weights: tuple) -> torch.Tensor:
    """The model's exact SwiGLU on rows h [N, hidden]: down(silu(gate(h)) * up(h))."""
    gate_up, inter, down = weights
    if isinstance(gate_up, torch.Tensor):
        gu = exact_linear(h, gate_up)
        gate, up = gu[:, :inter], gu[:, inter:]
    else:
        gate, up = exact_linear(h, gate_up[0]), exact_linear(h, gate_up[1])
    return exact_linear(exact_silu(gate) * up, down)


def exact_qkv(h: torch.Tensor, layer: ExactLayer) -> torch.Tensor:
    """[q | k | v] projections of rows h [N, hidden], each as the model's own GEMM rounds it."""
    if isinstance(layer.qkv, torch.Tensor):
        return exact_linear(h, layer.qkv)
    return torch.cat([exact_linear(h, w) for w in layer.qkv], dim=1)


def exact_experts(h: torch.Tensor, layer: ExactLayer, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The MoE block's weighted expert sum [N, hidden] as the model computes it: expert e sees its
    tokens' rows in token order; the results are added into zeros in ascending expert order (one
    sequential `index_add_` over the rows sorted by expert, stable)."""
    k = experts.shape[1]
    sorted_experts, order = experts.view(-1).sort(stable=True)
    token_of = order // k
    w = weights.reshape(-1)[order, None]
    if layer.batched is not None:
        y = _experts_batched(h, layer, sorted_experts, token_of)
    else:
        ends = torch.searchsorted(sorted_experts, layer.expert_ids).tolist()
        parts, start = [], 0
        for e, end in enumerate(ends):
            if end > start:
                parts.append(exact_mlp(h[token_of[start:end]], layer.experts[e]))
                start = end
        y = torch.cat(parts)
    out = torch.zeros_like(h)
    return out.index_add_(0, token_of, (y * w).to(out.dtype))


def _experts_batched(h: torch.Tensor, layer: ExactLayer, sorted_experts: torch.Tensor,
                     token_of: torch.Tensor) -> torch.Tensor:
    """Every (token, expert) row's expert MLP output, in sorted order: the experts' rows zero-padded
    to one count R (at least the GEMM's invariant row count) and run as two batched GEMMs."""
    w_gate_up, w_down = layer.batched
    E, hidden, inter = w_gate_up.shape[0], h.shape[1], w_down.shape[1]
    counts = torch.bincount(sorted_experts, minlength=E)
    R = max(int(counts.max()), layer.min_rows)
    rank = torch.arange(sorted_experts.shape[0], device=h.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = sorted_experts * R + rank
    x = h.new_zeros(E * R, hidden).index_copy_(0, dest, h[token_of])
    gu = torch.bmm(x.view(E, R, hidden), w_gate_up)
    act = exact_silu(gu[..., :inter]) * gu[..., inter:]
    return torch.bmm(act, w_down).view(E * R, hidden)[dest]


def key_blocks(cache: StaticKVCache, length: int) -> int:
    """How many cache columns attention reads for `length` keys: whole key blocks of the exact
    attention while the slot holds them (the masked columns past `length` weigh exactly 0, so
    reading them spares a padded copy of K and V), else `length` (exact_attention pads)."""
    full = -(-length // KEY_BLOCK) * KEY_BLOCK
    return full if full <= cache.max_seq_len else length


def decode_attention(cache: StaticKVCache, positions: torch.Tensor, kv_len: int,
                     scale: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """`attend(layer, q [n, H, D])` → [n, H, D] for one decode step over slots [0, n): the exact
    attention of each slot's query over its cache columns [0, position]."""
    n = positions.shape[0]
    width = key_blocks(cache, kv_len)
    visible = torch.arange(width, device=positions.device) <= positions[:, None]
    # additive (0 / -inf), built once for the step's layers: cheaper per layer than a bool mask
    mask = torch.zeros(visible.shape, device=positions.device).masked_fill_(~visible, float("-inf"))
    mask, own = mask[:, None, None], positions[:, None, None]                                 # [n, 1, 1, K]

    def attend(li: int, q: torch.Tensor) -> torch.Tensor:
        k, v = cache.view(li, n, width)
        return exact_attention(q[:, :, None], k, v, mask, scale, own=own)[:, :, 0]

    return attend


def prefill_attention(cache: StaticKVCache, slot_kv: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                      q_pos: torch.Tensor, seq_of: torch.Tensor, local: torch.Tensor,
                      scale: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """`attend(layer, q [N, H, D])` → [N, H, D] for a prefill of packed rows: row r is query
    `local[r]` of prompt `seq_of[r]`, at position q_pos[seq, local]; key j is visible to the
    query at position p iff j <= p (the slot's cached prefix included). Padded [B, Q] layout."""
    B, Q = q_pos.shape
    width = key_blocks(cache, int(q_pos.max()) + 1)
    mask = (torch.arange(width, device=q_pos.device) <= q_pos[:, :, None])[:, None]           # [B, 1, Q, K]
    own = q_pos[:, None]
    padded_rows = seq_of * Q + local

    def attend(li: int, q: torch.Tensor) -> torch.Tensor:
        H, D = q.shape[1:]
        k, v = slot_kv(li, width)
        q_pad = q.new_zeros(B * Q, H, D)  # pad query rows attend like any row; they are dropped
        q_pad[padded_rows] = q
        out = exact_attention(q_pad.view(B, Q, H, D).transpose(1, 2), k, v, mask, scale, own=own)
        return out.transpose(1, 2)[seq_of, local]

    return attend
