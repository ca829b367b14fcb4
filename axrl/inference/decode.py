"""The decode hot path: one new token per slot through the policy, specialised for S == 1.

`Qwen3ForCausalLM.forward` is written for training (any sequence length, routing replay, GQA via
`repeat_interleave`, a Python loop over experts). On a CPU with a tiny model a decode step is
dominated by per-op overhead, not FLOPs, so `FusedDecoder` computes the *same math* for one
position per row with under a third of the top-level ops (≈240 instead of ≈790 per step for
tiny-moe at batch 16):

* q/k/v projections in one GEMM (weights concatenated once); q_norm and k_norm in one RMSNorm;
* RoPE on q and k at once from cos/sin tables built with the model's own `RotaryEmbedding`;
* GQA without copying the cache: the `rep` query heads that share a KV head act as the query
  rows of one attention over the cache view (baddbmm/softmax/bmm in fp32 — cheaper than SDPA's
  CPU kernel at decode sizes; SDPA for bf16/fp16, which accumulates in fp32);
* MoE experts at decode batch sizes as two `embedding_bag` calls (see `_experts_bags`): no sort,
  no per-expert GEMM; bigger batches use `grouped_mm` over the (token, expert) rows sorted by
  expert, accumulated in the same order as the model's `index_add_`.

Results match the model's forward to float rounding (GEMM shapes differ, as in any KV-cache
decode); tests check tokens, logprobs and routing against a plain full forward, and the engine
can decode through the model's own forward instead (`decode_impl="model"`) as a reference.

Packed weights are copies: call `repack()` after the model's weights change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axrl.inference.kv_cache import StaticKVCache
from axrl.model import Qwen3ForCausalLM


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """axrl.model.qwen3.RMSNorm(x) with `weight`: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        # One dispatch instead of six; bitwise equal to the model's formula for fp32 inputs
        # (checked on torch 2.13 CPU). Other dtypes keep the model's exact op sequence.
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight  # per-head weights [heads, D]
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _grouped_mm_works(dtype: torch.dtype) -> bool:
    """Whether this torch build has a usable grouped GEMM for `dtype` on CPU."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        a, b = torch.ones(4, 16, dtype=dtype), torch.ones(2, 16, 16, dtype=dtype)
        out = F.grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
        return bool(torch.all(out == 16))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class _LayerWeights:
    """One decoder layer's weights, packed for the single-token path."""

    def __init__(self, layer: torch.nn.Module, n_heads: int, n_kv: int) -> None:
        attn = layer.self_attn
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qk_eps = attn.q_norm.eps
        self.w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
        d = attn.head_dim
        self.qk_norm = torch.cat([attn.q_norm.weight.expand(n_heads, d), attn.k_norm.weight.expand(n_kv, d)])
        self.w_o = attn.o_proj.weight
        self.is_moe = layer.is_moe
        mlp = layer.mlp
        if self.is_moe:
            self.w_router = mlp.gate.weight
            self.top_k, self.norm_topk_prob, self.num_experts = mlp.top_k, mlp.norm_topk_prob, mlp.num_experts
            self.inter = mlp.experts[0].gate_proj.weight.shape[0]
            # [E, hidden, 2*inter] and [E, inter, hidden]: right-hand operands of x @ W.
            self.w_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).t()
                                          for e in mlp.experts]).contiguous()
            self.w_down = torch.stack([e.down_proj.weight.t() for e in mlp.experts]).contiguous()
            # The same storage as embedding tables: row e*hidden + c is W_gate_up[e][c, :], and
            # row e*inter + i is W_down[e][i, :] (views, no copy).
            self.gate_up_rows = self.w_gate_up.view(-1, 2 * self.inter)
            self.down_rows = self.w_down.view(-1, self.w_down.shape[-1])
        else:
            self.inter = mlp.gate_proj.weight.shape[0]
            self.w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
            self.w_down = mlp.down_proj.weight


class FusedDecoder:
    """Runs one decode step for slots [0, n) of a `StaticKVCache`; see the module docstring."""

    def __init__(self, model: Qwen3ForCausalLM, max_seq_len: int, max_batch_size: int) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        cfg = model.config
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rep = self.n_heads // self.n_kv
        self.max_seq_len = max_seq_len
        self.is_moe = cfg.is_moe
        self.top_k = cfg.num_experts_per_tok
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        """(Re)build the packed weight copies and the rotary table from the model's parameters."""
        m = self.model
        cfg = m.config
        dtype = m.lm_head.weight.dtype
        self.dtype = dtype
        self.layers = [_LayerWeights(layer, self.n_heads, self.n_kv) for layer in m.model.layers]
        self.embed = m.model.embed_tokens.weight
        self.final_norm, self.final_eps = m.model.norm.weight, m.model.norm.eps
        positions = torch.arange(self.max_seq_len, device=self.embed.device)[None]
        cos, sin = m.model.rotary_emb(positions, dtype)  # the model's own computation, tabulated
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin[:half], sin[half:]] (a sign flip is exact),
        # which saves the chunk/neg/cat of rotate_half.
        self.cos = cos[0]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self.rows = torch.arange(self.max_batch_size, device=self.embed.device)
        self.grouped = self.is_moe and _grouped_mm_works(dtype)
        # Expert FFNs as embedding bags (fp32 only: the bag sums accumulate in the table's dtype).
        # Measured on tiny-moe, 1 thread: a whole MoE block at 16 tokens costs ~110 us this way vs
        # ~200 us with sort + 2 grouped_mm (whose CPU kernel is a loop of 8 small GEMMs of ~4 rows
        # each, mostly fixed per-call cost); at 64 tokens the two are even, beyond it grouped_mm wins.
        self.bag_max_rows = 16 * cfg.num_experts if self.is_moe and dtype == torch.float32 else 0
        if self.is_moe:
            hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, self.top_k
            dev = self.embed.device
            self.hidden_range, self.inter_range = torch.arange(hidden, device=dev), torch.arange(inter, device=dev)
            # Bag starts: one bag of `hidden` rows per (token, expert) pair; one bag of k*inter rows per token.
            self.gate_up_offsets = torch.arange(0, max(self.max_batch_size * k * hidden, 1), hidden, device=dev)
            self.down_offsets = torch.arange(0, max(self.max_batch_size * k * inter, 1), k * inter, device=dev)
        # Expert ids 1..E: searchsorted over the sorted assignments gives each expert's end offset.
        self.expert_ends = torch.arange(1, self.model.config.num_experts + 1, device=self.embed.device)
        # fp32: attention as baddbmm/softmax/bmm (3 ops; SDPA's CPU kernel costs more per call at
        # decode sizes). Lower precisions keep SDPA, which accumulates in fp32.
        self.manual_attention = dtype == torch.float32

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, kv_len: int,
             need_routing: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens [n] at positions [n] for slots [0, n); returns the final-norm hidden states
        [n, hidden] and, if asked on an MoE model, routing [n, layers, top_k] (int64)."""
        n = tokens.shape[0]
        H, KV, D, rep = self.n_heads, self.n_kv, self.head_dim, self.rep
        rows = self.rows[:n]
        x = F.embedding(tokens, self.embed)
        # Per-step tables shared by all layers.
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [n, 1, D]
        # Key j of slot i is visible iff j <= positions[i]: the slot's own history, nothing stale.
        visible = torch.arange(kv_len, device=tokens.device)[None] <= positions[:, None]  # [n, K]
        if self.manual_attention:
            # Additive bias, one row per (slot, kv head), broadcast over the rep query heads.
            bias = torch.zeros(n, kv_len, dtype=x.dtype).masked_fill_(~visible, float("-inf"))
            bias = bias[:, None, None, :].expand(n, KV, 1, kv_len).reshape(n * KV, 1, kv_len)
        else:
            mask = visible[:, None, None, :]
        routing: list[torch.Tensor] = []
        for li, w in enumerate(self.layers):
            qkv = F.linear(_norm(x, w.input_norm, w.eps), w.w_qkv)
            qk = _norm(qkv[:, :(H + KV) * D].view(n, H + KV, D), w.qk_norm, w.qk_eps)
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # RoPE on q and k at once
            cache.write_decode(li, rows, positions, qk[:, H:], qkv[:, (H + KV) * D:].view(n, KV, D))
            k_all, v_all = cache.view(li, n, kv_len)  # [n, KV, K, D] views
            # GQA without repeat_interleave: the `rep` query heads of a KV head act as its query rows.
            q = qk[:, :H].reshape(n, KV, rep, D)
            if self.manual_attention:
                scores = torch.baddbmm(bias, q.reshape(n * KV, rep, D),
                                       k_all.reshape(n * KV, kv_len, D).transpose(1, 2), alpha=D ** -0.5)
                attn = torch.bmm(torch.softmax(scores, dim=-1), v_all.reshape(n * KV, kv_len, D))
            else:
                attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=D ** -0.5)
            x = x + F.linear(attn.reshape(n, H * D), w.w_o)
            h = _norm(x, w.post_norm, w.eps)
            if w.is_moe:
                out, experts = self._moe(h, w)
                if need_routing:
                    routing.append(experts)
            else:
                gu = F.linear(h, w.w_gate_up)
                out = F.linear(F.silu(gu[:, :w.inter]) * gu[:, w.inter:], w.w_down)
                if need_routing and self.is_moe:  # dense layer inside an MoE model: zeros, as the model does
                    routing.append(torch.zeros(n, self.top_k, dtype=torch.long, device=x.device))
            x = x + out
        hidden = _norm(x, self.final_norm, self.final_eps)
        return hidden, (torch.stack(routing, dim=1) if routing else None)

    def _moe(self, h: torch.Tensor, w: _LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse MoE block for h [n, hidden] → (out [n, hidden], experts [n, top_k])."""
        probs = F.softmax(F.linear(h, w.w_router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, w.top_k, dim=-1)
        if w.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if weights.dtype != h.dtype:
            weights = weights.to(h.dtype)
        if h.shape[0] * w.top_k <= self.bag_max_rows:
            return self._experts_bags(h, w, weights, experts), experts
        return self._experts_sorted(h, w, weights, experts), experts

    def _experts_bags(self, h: torch.Tensor, w: _LayerWeights, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
        """The experts as two `embedding_bag` sums over the stacked expert weights, read as tables.

        x @ W == sum_c x[c] * W[c, :], a bag of W's rows weighted by x. So gate/up for the pair
        (token t, expert e) is the bag {rows e*hidden + c} weighted by h[t], and a token's whole
        output sum_j weight_j * act_j @ W_down[e_j] is one bag of k*inter rows of the down table
        weighted by weight_j * act_j. One kernel call per projection, no sorting, no scatter-add.
        """
        n, hidden = h.shape
        k, inter = w.top_k, w.inter
        rows = torch.add(self.hidden_range, experts.view(-1, 1), alpha=hidden).view(-1)
        gu = F.embedding_bag(rows, w.gate_up_rows, self.gate_up_offsets[:n * k], mode="sum",
                             per_sample_weights=h[:, None].expand(n, k, hidden).reshape(-1))
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n*k, inter], pairs in (token, j) order
        rows = torch.add(self.inter_range, experts.view(n, k, 1), alpha=inter).view(-1)
        return F.embedding_bag(rows, w.down_rows, self.down_offsets[:n], mode="sum",
                               per_sample_weights=(act.view(n, k, inter) * weights[:, :, None]).view(-1))

    def _experts_sorted(self, h: torch.Tensor, w: _LayerWeights, weights: torch.Tensor,
                        experts: torch.Tensor) -> torch.Tensor:
        """The experts over (token, expert) rows sorted by expert: grouped_mm, or a loop of GEMMs."""
        # Sort the (token, expert) assignments by expert so each expert's rows are contiguous;
        # stable, so a token's rows keep their order and index_add sums them as the model does.
        sorted_experts, order = experts.view(-1).sort(stable=True)
        token_of = order // w.top_k
        xs = h[token_of]
        # offs[e] = end of expert e's rows.
        offs = torch.searchsorted(sorted_experts, self.expert_ends, out_int32=True)
        if self.grouped:
            gu = F.grouped_mm(xs, w.w_gate_up, offs=offs)
            y = F.grouped_mm(F.silu(gu[:, :w.inter]) * gu[:, w.inter:], w.w_down, offs=offs)
        else:
            parts, start = [], 0
            for e, end in enumerate(offs.tolist()):
                if end > start:
                    gu = xs[start:end] @ w.w_gate_up[e]
                    parts.append((F.silu(gu[:, :w.inter]) * gu[:, w.inter:]) @ w.w_down[e])
                    start = end
            y = torch.cat(parts)
        y = y * weights.view(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, token_of, y)
