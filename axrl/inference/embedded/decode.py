"""The fast path: decode (one new token per slot) and prefill (whole prompts) for the policy.

`Qwen3ForCausalLM.forward` is written for training (any sequence length, routing replay, GQA via
`repeat_interleave`, a Python loop over experts). On a CPU with a tiny model a decode step is
dominated by per-op overhead and cache misses, not FLOPs, so `FusedDecoder` computes the *same
math* with far fewer and cheaper ops:

* q/k/v projections in one GEMM (weights concatenated once); q_norm and k_norm in one RMSNorm;
* RoPE on q and k at once from cos/sin tables built with the model's own `RotaryEmbedding`;
* GQA without copying the cache: the `rep` query heads that share a KV head act as the query
  rows of one attention over the cache view (fp32: baddbmm, softmax, then probs @ V as an
  `embedding_bag` over the V cache rows — cheaper than SDPA's CPU kernel at decode sizes; SDPA
  for bf16/fp16, which accumulates in fp32);
* residual adds folded into the GEMM (addmm) or the expert scatter (index_add_ into x);
* MoE experts at decode batch sizes as two `embedding_bag` calls (see `_experts_bags`): no sort,
  no per-expert GEMM; bigger batches (and prefill) use `grouped_mm` over the (token, expert) rows
  sorted by expert;
* prefill on the packed real tokens of all prompts (no padding rows in the GEMMs), attention alone
  in a padded layout.

Results match the model's forward to float rounding (GEMM shapes and summation order differ, as
in any KV-cache decode); tests check tokens, logprobs and routing against a plain full forward,
and the engine can run the model's own forward instead (`decode_impl="model"`) as a reference.

Packed weights are copies: call `repack()` after the model's weights change.

W8A8 rollout (`rollout.precision: fp8_w8a8`, `axrl.inference.quant`): the input of every quantised
linear layer (q/k/v, o, gate/up and down, dense and experts) passes through `_act`, the same
per-token-group fp8 quantise → dequantise the fp8 GEMM's activation side applies; the router and
lm_head inputs do not. Without it `_act` is the identity.

Both passes take an optional `probe` (`axrl.model.ActivationProbe`): the same hook points as the
model's forward ("in", "mid", "router", "out" per layer, then "final"), on the packed rows [N, ...]
this path computes (prefill: the final norm only at each prompt's last token). Mismatch
attribution (replay/explain.py) reads the engine's activations through it; without one nothing
changes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from axrl.inference.embedded.exact_layers import (ExactLayer, decode_attention, exact_experts, exact_mlp, exact_qkv,
                                                  prefill_attention)
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.inference.quant import activation_rounding
from axrl.model import ActivationProbe, Qwen3ForCausalLM
from axrl.model.exact import exact_linear, is_exact


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
    """One decoder layer's weights, packed for the fast path."""

    def __init__(self, layer: torch.nn.Module, n_heads: int, n_kv: int, exact: bool) -> None:
        attn = layer.self_attn
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qk_eps = attn.q_norm.eps
        self.w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
        d = attn.head_dim
        self.qk_norm = torch.cat([attn.q_norm.weight.expand(n_heads, d), attn.k_norm.weight.expand(n_kv, d)])
        # Right-hand operands of addmm(x, a, W.T): the residual add rides in the GEMM.
        self.w_o_t = attn.o_proj.weight.t()
        self.is_moe = layer.is_moe
        self.exact = ExactLayer(layer) if exact else None  # the weights as the exact op set reads them
        mlp = layer.mlp
        if self.is_moe:
            self.w_router = mlp.gate.weight
            self.top_k, self.norm_topk_prob, self.num_experts = mlp.top_k, mlp.norm_topk_prob, mlp.num_experts
            self.inter = mlp.experts[0].gate_proj.weight.shape[0]
            # [E, hidden, 2*inter] and [E, inter, hidden]: right-hand operands of x @ W.
            self.w_gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).t()
                                          for e in mlp.experts]).contiguous()
            self.w_down = torch.stack([e.down_proj.weight.t() for e in mlp.experts]).contiguous()
            # The same storage read as embedding tables: row e*hidden + c is W_gate_up[e][c, :],
            # row e*inter + i is W_down[e][i, :] (views, no copy).
            self.gate_up_rows = self.w_gate_up.view(-1, 2 * self.inter)
            self.down_rows = self.w_down.view(-1, self.w_down.shape[-1])
        else:
            self.inter = mlp.gate_proj.weight.shape[0]
            self.w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
            self.w_down_t = mlp.down_proj.weight.t()


def _slot_kv(cache: StaticKVCache, layer: int, slots: list[int], slot_t: torch.Tensor, contiguous: bool,
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s K and V of the given cache slots, positions [0, length): [B, KV, length, D].
    Views in the usual case (admission fills the lowest free slots, so they are contiguous)."""
    k, v = cache.k[layer], cache.v[layer]
    if contiguous:
        return k[slots[0]:slots[0] + len(slots), :, :length], v[slots[0]:slots[0] + len(slots), :, :length]
    return k[slot_t, :, :length], v[slot_t, :, :length]


class FusedDecoder:
    """Decode steps and prefills over the slots of a `StaticKVCache`; see the module docstring."""

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
        self.act = activation_rounding(m)
        # rollout.exact: every layer half through the exact op set (exact_layers.py), bitwise the
        # model's exact forward; refused with a quantised rollout, which has no exact form.
        self.exact = is_exact(m)
        if self.exact and self.act is not None:
            raise ValueError("rollout.exact: the exact op set has no W8A8 form; set rollout.precision: auto")
        self.layers = [_LayerWeights(layer, self.n_heads, self.n_kv, self.exact) for layer in m.model.layers]
        self.embed = m.model.embed_tokens.weight
        dev = self.embed.device
        self.final_norm, self.final_eps = m.model.norm.weight, m.model.norm.eps
        positions = torch.arange(self.max_seq_len, device=dev)[None]
        cos, sin = m.model.rotary_emb(positions, dtype)  # the model's own computation, tabulated
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin[:half], sin[half:]] (a sign flip is exact),
        # which saves the chunk/neg/cat of rotate_half.
        self.cos = cos[0]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self.grouped = self.is_moe and _grouped_mm_works(dtype)
        # Expert FFNs as embedding bags (fp32 only: the bag sums accumulate in the table's dtype).
        # Measured on tiny-moe, 1 thread: a whole MoE block at 16 tokens costs ~110 us this way vs
        # ~200 us with sort + 2 grouped_mm (whose CPU kernel is a loop of 8 small GEMMs of ~4 rows
        # each, mostly fixed per-call cost); at 64 tokens the two are even, beyond it grouped_mm wins.
        self.bag_max_rows = 16 * cfg.num_experts if self.is_moe and dtype == torch.float32 else 0
        if self.is_moe:
            hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, self.top_k
            self.hidden_range, self.inter_range = torch.arange(hidden, device=dev), torch.arange(inter, device=dev)
            # Bag starts: one bag of `hidden` rows per (token, expert) pair; one of k*inter rows per token.
            max_pairs = max(self.bag_max_rows, 1)
            self.gate_up_offsets = torch.arange(0, max_pairs * hidden, hidden, device=dev)
            self.down_offsets = torch.arange(0, max_pairs * inter, k * inter, device=dev)
            # Expert ids 1..E: searchsorted over the sorted assignments gives each expert's end offset.
            self.expert_ends = torch.arange(1, cfg.num_experts + 1, device=dev)
        self.key_range = torch.arange(self.max_seq_len, device=dev).expand(self.n_kv, self.max_seq_len)
        self.bias_values = torch.tensor([float("-inf"), 0.0], dtype=dtype, device=dev)
        # fp32: attention as baddbmm/softmax/embedding_bag (3 ops; SDPA's CPU kernel costs more per
        # call at decode sizes). Lower precisions keep SDPA, which accumulates in fp32.
        self.manual_attention = dtype == torch.float32

    # -- decode ------------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, kv_len: int,
             need_routing: bool, probe: ActivationProbe | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens [n] at positions [n] for slots [0, n); returns the final-norm hidden states
        [n, hidden] and, if asked on an MoE model, routing [n, layers, top_k] (int64)."""
        cache_rows = (cache.row_base[:tokens.shape[0]] + positions[:, None]).view(-1)  # where this step's K/V go
        if self.exact:
            attend = decode_attention(cache, positions, kv_len, self.head_dim ** -0.5)
        else:
            attend = self._decode_attention(cache, positions, kv_len)
        x, routing = self._layers(tokens, positions, cache, cache_rows, attend, need_routing, probe)
        hidden = _norm(x, self.final_norm, self.final_eps)
        if probe is not None:
            hidden = probe.at("final", -1, hidden)
        return hidden, routing

    def _decode_attention(self, cache: StaticKVCache, positions: torch.Tensor,
                          kv_len: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """`attend(layer, q [n, H, D])` → [n, H, D] of one decode step (the fast, inexact form)."""
        n = positions.shape[0]
        H, KV, D, rep = self.n_heads, self.n_kv, self.head_dim, self.rep
        # Key j of slot i is hidden iff j > positions[i]: only the slot's own history, nothing stale.
        if not self.manual_attention:
            mask = (self.key_range[0, :kv_len] <= positions[:, None])[:, None, None, :]

            def attend_sdpa(li: int, q: torch.Tensor) -> torch.Tensor:
                k_all, v_all = cache.view(li, n, kv_len)  # [n, KV, K, D] views
                # GQA without repeat_interleave: the `rep` query heads of a KV head act as its query rows.
                return F.scaled_dot_product_attention(q.reshape(n, KV, rep, D), k_all, v_all, attn_mask=mask,
                                                      scale=D ** -0.5)

            return attend_sdpa
        # Additive bias, one row per (slot, kv head), broadcast over the rep query heads.
        masked = self.key_range[:, :kv_len] > positions[:, None, None]  # [n, KV, K]
        bias = torch.where(masked, self.bias_values[0], self.bias_values[1]).view(n * KV, 1, kv_len)
        # probs @ V as one embedding bag per query head: the (slot, kv head)'s cache rows 0..K-1
        # of V, weighted by the head's probabilities (masked keys weigh exactly 0). Measured in
        # the engine: ~8% of a batch-64 decode step and ~2% at batch 16 cheaper than the bmm
        # (a loop of n*KV GEMMs with 2 rows each).
        pv_rows = (cache.row_base[:n, :, None, None] + self.key_range[0, :kv_len]).expand(
            n, KV, rep, kv_len).reshape(-1)
        pv_offsets = torch.arange(0, n * H * kv_len, kv_len, device=positions.device)

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            k_all = cache.view(li, n, kv_len)[0]
            scores = torch.baddbmm(bias, q.reshape(n * KV, rep, D),
                                   k_all.reshape(n * KV, kv_len, D).transpose(1, 2), alpha=D ** -0.5)
            return F.embedding_bag(pv_rows, cache.v[li].view(-1, D), pv_offsets, mode="sum",
                                   per_sample_weights=torch.softmax(scores, dim=-1).view(-1))

        return attend

    # -- prefill -----------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], slots: list[int], cache: StaticKVCache,
                need_routing: bool, probe: ActivationProbe | None = None, *,
                starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed whole prompts into the given cache slots; returns the final-norm hidden state of each
        prompt's last token [B, hidden] and, if asked on an MoE model, routing for every prompt token
        [sum(lens), layers, top_k] (int64, prompts concatenated).

        `starts[i]` > 0: the slot already holds K/V for the prompt's first starts[i] tokens (a
        prefix-cache hit, `prefix_cache.py`); only the rest is computed, attending over all of it,
        and the routing covers only the computed tokens.

        The same math as the model's forward over a right-padded batch, but the row-wise work
        (GEMMs, norms, RoPE, MoE) runs on the packed real tokens only — the bench's prompts are 25%
        padding. Attention alone uses a padded [B, S] layout: causal SDPA, with keys and values read
        back from the cache slots; no real query sees a pad position, and pad queries are dropped.
        """
        if starts is not None and any(starts):
            return self._prefill_after(prompts, slots, cache, need_routing, starts, probe)
        dev = self.embed.device
        H, D = self.n_heads, self.head_dim
        lens = [len(p) for p in prompts]
        B, S = len(prompts), max(lens)
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.tensor([i for n in lens for i in range(n)], device=dev)
        seq_of = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(lens, device=dev))
        slot_t = torch.tensor(slots, device=dev)
        cache_rows = cache.rows(slot_t[seq_of], positions)  # where each token's K/V go
        padded_rows = seq_of * S + positions  # the token's row in the padded [B*S] layout
        contiguous_slots = slots == list(range(slots[0], slots[0] + B))

        if self.exact:
            attend = prefill_attention(
                cache, lambda li, width: _slot_kv(cache, li, slots, slot_t, contiguous_slots, width),
                torch.arange(S, device=dev).expand(B, S), seq_of, positions, D ** -0.5)
            return self._prefill_layers(tokens, positions, cache, cache_rows, lens, attend, need_routing, probe)

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            k_pad, v_pad = _slot_kv(cache, li, slots, slot_t, contiguous_slots, S)
            # Pad query rows are never read, so they may hold anything (no zero fill).
            q_pad = q.new_empty(B * S, H, D)
            q_pad[padded_rows] = q
            attn = F.scaled_dot_product_attention(q_pad.view(B, S, H, D).transpose(1, 2), k_pad, v_pad,
                                                  is_causal=True, scale=D ** -0.5, enable_gqa=True)
            return attn.transpose(1, 2)[seq_of, positions]  # [N, H, D]: the real queries

        return self._prefill_layers(tokens, positions, cache, cache_rows, lens, attend, need_routing, probe)

    def _prefill_after(self, prompts: list[list[int]], slots: list[int], cache: StaticKVCache,
                       need_routing: bool, starts: list[int],
                       probe: ActivationProbe | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`prefill` of prompts[i][starts[i]:] over slots that hold the first starts[i] tokens:
        the same row-wise work on the new tokens; attention in a padded [B, new] × [B, K] layout
        with an explicit mask (key j visible to the query at position p iff j <= p)."""
        dev = self.embed.device
        H, D = self.n_heads, self.head_dim
        lens = [len(p) for p in prompts]
        new = [n - s for n, s in zip(lens, starts)]
        B, Q, K = len(prompts), max(new), max(lens)
        tokens = torch.tensor([t for p, s in zip(prompts, starts) for t in p[s:]], device=dev)
        local = torch.tensor([i for n in new for i in range(n)], device=dev)
        seq_of = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(new, device=dev))
        positions = local + torch.tensor(starts, device=dev)[seq_of]
        slot_t = torch.tensor(slots, device=dev)
        cache_rows = cache.rows(slot_t[seq_of], positions)
        padded_rows = seq_of * Q + local
        contiguous_slots = slots == list(range(slots[0], slots[0] + B))
        q_pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(Q, device=dev)[None]  # [B, Q]
        # key j visible to the query at position p iff j <= p (SDPA with a bool mask: measured faster
        # here than baddbmm/softmax/bmm, unlike decode's one-query case)
        if self.exact:
            attend = prefill_attention(
                cache, lambda li, width: _slot_kv(cache, li, slots, slot_t, contiguous_slots, width),
                q_pos, seq_of, local, D ** -0.5)
            return self._prefill_layers(tokens, positions, cache, cache_rows, new, attend, need_routing, probe)
        mask = (torch.arange(K, device=dev)[None, None] <= q_pos[:, :, None])[:, None]         # [B, 1, Q, K]

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            k_pad, v_pad = _slot_kv(cache, li, slots, slot_t, contiguous_slots, K)
            q_pad = q.new_zeros(B * Q, H, D)  # pad query rows see key 0 at least: no NaN, never read
            q_pad[padded_rows] = q
            attn = F.scaled_dot_product_attention(q_pad.view(B, Q, H, D).transpose(1, 2), k_pad, v_pad,
                                                  attn_mask=mask, scale=D ** -0.5, enable_gqa=True)
            return attn.transpose(1, 2)[seq_of, local]

        return self._prefill_layers(tokens, positions, cache, cache_rows, new, attend, need_routing, probe)

    def _prefill_layers(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                        cache_rows: torch.Tensor, lens: list[int],
                        attend: Callable[[int, torch.Tensor], torch.Tensor], need_routing: bool,
                        probe: ActivationProbe | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers of a prefill over packed tokens [N] (`lens` per prompt); the last token's
        hidden state per prompt (the full and the suffix prefill differ only in `attend`)."""
        x, routing = self._layers(tokens, positions, cache, cache_rows, attend, need_routing, probe)
        last = torch.tensor(lens, device=x.device).cumsum(0) - 1
        hidden = _norm(x[last], self.final_norm, self.final_eps)
        if probe is not None:
            hidden = probe.at("final", -1, hidden)
        return hidden, routing

    # -- the layer loop, shared by decode and prefill ----------------------------------------------
    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, cache_rows: torch.Tensor,
                attend: Callable[[int, torch.Tensor], torch.Tensor], need_routing: bool,
                probe: ActivationProbe | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every decoder layer over packed rows: tokens [N] at positions [N], their K/V written at
        `cache_rows`, `attend(layer, q [N, H, D])` → the rows' attention [N, H, D] (decode: over
        each slot's history; prefill: over the prompt). Returns the residual stream [N, hidden]
        and, if asked on an MoE model, the routing [N, layers, top_k]."""
        N, KV, D = tokens.shape[0], self.n_kv, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]  # [N, 1, D]
        x = F.embedding(tokens, self.embed)
        routing: list[torch.Tensor] = []
        for li, w in enumerate(self.layers):
            if probe is not None:
                x = probe.at("in", li, x)
            q, k, v = self._qkv(x, w, cos, sin)
            cache.write_rows(li, cache_rows, k.reshape(N * KV, D), v.reshape(N * KV, D))
            attn = attend(li, q).reshape(N, self.n_heads * D)
            if self.exact:  # the model's order: o_proj, then the residual add
                x = x + exact_linear(attn, w.exact.w_o)
            else:
                x = torch.addmm(x, self._act(attn), w.w_o_t)
            x = self._layer_rest(x, w, li, routing if need_routing else None, probe)
        return x, (torch.stack(routing, dim=1) if routing else None)

    # -- shared layer halves -----------------------------------------------------------------------
    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """A quantised linear layer's input as its GEMM sees it (fp8-rounded under W8A8, else x)."""
        return x if self.act is None else self.act(x)

    def _qkv(self, x: torch.Tensor, w: _LayerWeights, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows x [N, hidden] → q [N, H, D], k [N, KV, D] (normed, rotated) and v [N, KV, D] (views)."""
        N = x.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        h = self._act(_norm(x, w.input_norm, w.eps))
        if self.exact:  # bitwise the model's three GEMMs
            qkv = exact_qkv(h, w.exact)
        else:
            qkv = F.linear(h, w.w_qkv)
        qk = _norm(qkv[:, :(H + KV) * D].view(N, H + KV, D), w.qk_norm, w.qk_eps)
        qk = qk * cos + qk.roll(D // 2, dims=-1) * sin  # RoPE on q and k at once
        return qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(N, KV, D)

    def _layer_rest(self, x: torch.Tensor, w: _LayerWeights, li: int, routing: list[torch.Tensor] | None,
                    probe: ActivationProbe | None) -> torch.Tensor:
        """The layer after its attention: the probe's "mid" and "out" points around `_ffn`."""
        if probe is None:
            return self._ffn(x, w, routing)
        x = probe.at("mid", li, x)
        return probe.at("out", li, self._ffn(x, w, routing, probe, li))

    def _ffn(self, x: torch.Tensor, w: _LayerWeights, routing: list[torch.Tensor] | None,
             probe: ActivationProbe | None = None, li: int = -1) -> torch.Tensor:
        """x + MLP(post_norm(x)) for rows x [N, hidden] (x is owned here and may be updated in place);
        appends the layer's expert choices [N, top_k] to `routing` when given."""
        h = _norm(x, w.post_norm, w.eps)
        if self.exact:
            return self._ffn_exact(x, h, w, routing, probe, li)
        if not w.is_moe:
            gu = F.linear(self._act(h), w.w_gate_up)
            if routing is not None and self.is_moe:  # dense layer inside an MoE model: zeros, as the model does
                routing.append(torch.zeros(x.shape[0], self.top_k, dtype=torch.long, device=x.device))
            return torch.addmm(x, self._act(F.silu(gu[:, :w.inter]) * gu[:, w.inter:]), w.w_down_t)
        logits = F.linear(h, w.w_router)
        if probe is not None:
            logits = probe.at("router", li, logits)
        weights, experts = self._route(logits, w)
        if weights.dtype != h.dtype:
            weights = weights.to(h.dtype)
        if routing is not None:
            routing.append(experts)
        h = self._act(h)  # the experts' input (the router above read it unquantised)
        if h.shape[0] * w.top_k <= self.bag_max_rows:
            return x.add_(self._experts_bags(h, w, weights, experts))
        return self._experts_sorted(x, h, w, weights, experts)

    def _ffn_exact(self, x: torch.Tensor, h: torch.Tensor, w: _LayerWeights, routing: list[torch.Tensor] | None,
                   probe: ActivationProbe | None, li: int) -> torch.Tensor:
        """`_ffn` in the exact op set: the model's MLP / MoE block on rows h = post_norm(x)."""
        if not w.is_moe:
            if routing is not None and self.is_moe:
                routing.append(torch.zeros(x.shape[0], self.top_k, dtype=torch.long, device=x.device))
            return x + exact_mlp(h, w.exact.mlp)
        logits = exact_linear(h, w.w_router)
        if probe is not None:
            logits = probe.at("router", li, logits)
        weights, experts = self._route(logits, w)
        if routing is not None:
            routing.append(experts)
        return x + exact_experts(h, w.exact, weights.to(h.dtype), experts)

    def _route(self, logits: torch.Tensor, w: _LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's top-k: (weights [N, k] fp32, renormalised when the model does, experts [N, k])."""
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, w.top_k, dim=-1)
        if w.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def _experts_bags(self, h: torch.Tensor, w: _LayerWeights, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum [n, hidden] as two `embedding_bag` sums over the stacked expert
        weights, read as tables.

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
        act = self._act(F.silu(gu[:, :inter]) * gu[:, inter:])  # [n*k, inter], pairs in (token, j) order
        rows = torch.add(self.inter_range, experts.view(n, k, 1), alpha=inter).view(-1)
        return F.embedding_bag(rows, w.down_rows, self.down_offsets[:n], mode="sum",
                               per_sample_weights=(act.view(n, k, inter) * weights[:, :, None]).view(-1))

    def _experts_sorted(self, x: torch.Tensor, h: torch.Tensor, w: _LayerWeights, weights: torch.Tensor,
                        experts: torch.Tensor) -> torch.Tensor:
        """x + the experts' weighted sum, over (token, expert) rows sorted by expert: grouped_mm (or a
        loop of GEMMs), then one scatter-add straight into x."""
        # Stable sort: each expert's rows are contiguous and keep token order.
        sorted_experts, order = experts.view(-1).sort(stable=True)
        token_of = order // w.top_k
        xs = h[token_of]
        # offs[e] = end of expert e's rows.
        offs = torch.searchsorted(sorted_experts, self.expert_ends, out_int32=True)
        if self.grouped:
            gu = F.grouped_mm(xs, w.w_gate_up, offs=offs)
            y = F.grouped_mm(self._act(F.silu(gu[:, :w.inter]) * gu[:, w.inter:]), w.w_down, offs=offs)
        else:
            parts, start = [], 0
            for e, end in enumerate(offs.tolist()):
                if end > start:
                    gu = xs[start:end] @ w.w_gate_up[e]
                    parts.append(self._act(F.silu(gu[:, :w.inter]) * gu[:, w.inter:]) @ w.w_down[e])
                    start = end
            y = torch.cat(parts)
        return x.index_add_(0, token_of, y * weights.view(-1)[order, None])
