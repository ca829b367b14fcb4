"""The fused decoder's layer halves under `rollout.exact: true` (true on-policy).

`FusedDecoder` (decode.py) normally computes the model's math with cheaper, differently-rounded
ops (one q/k/v GEMM, residual adds inside addmm, experts as embedding bags, SDPA). Under the exact
op set (`axrl.model.exact`) a token's result must instead be the bitwise result of the model's own
exact forward, as the torch trainer runs it: so here every GEMM is `exact_linear` on the model's
own weight (q, k and v separately, the residual added after), SiLU is `exact_silu`, attention is
`exact_attention` (grouped-query, over the KV cache's view in whole key blocks: no copies), and the
experts run as the model's MoE block does — each expert's rows in token order, combined into a zero
tensor with `index_add_` in ascending expert order. What stays fused is everything that is
row-local and bitwise the model's: packed prompt rows, RMSNorm, the RoPE table, the K/V writes.
"""

from __future__ import annotations

from typing import Callable

import torch

from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.model.exact import KEY_BLOCK, exact_attention, exact_linear, exact_silu


class ExactLayer:
    """One decoder layer's weights as the exact ops read them: the model's parameters (no copies)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn = layer.self_attn
        self.w_q, self.w_k, self.w_v, self.w_o = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                                                  attn.o_proj.weight)
        mlp = layer.mlp
        if layer.is_moe:
            self.experts = [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight) for e in mlp.experts]
            self.expert_ids = torch.arange(1, len(self.experts) + 1, device=self.w_q.device)
        else:
            self.mlp = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def exact_mlp(h: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's exact SwiGLU on rows h [N, hidden]: down(silu(gate(h)) * up(h))."""
    gate, up, down = weights
    return exact_linear(exact_silu(exact_linear(h, gate)) * exact_linear(h, up), down)


def exact_experts(h: torch.Tensor, layer: ExactLayer, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The MoE block's weighted expert sum [N, hidden] as the model computes it: expert e sees its
    tokens' rows in token order; the results are added into zeros in ascending expert order (one
    sequential `index_add_` over the rows sorted by expert, stable)."""
    k = experts.shape[1]
    sorted_experts, order = experts.view(-1).sort(stable=True)
    ends = torch.searchsorted(sorted_experts, layer.expert_ids).tolist()
    token_of = order // k
    w = weights.reshape(-1)[order, None]
    parts, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            parts.append(exact_mlp(h[token_of[start:end]], layer.experts[e]) * w[start:end])
            start = end
    out = torch.zeros_like(h)
    return out.index_add_(0, token_of, torch.cat(parts).to(out.dtype))


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
    mask = (torch.arange(width, device=positions.device) <= positions[:, None])[:, None, None]   # [n, 1, 1, K]
    own = positions[:, None, None]

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
