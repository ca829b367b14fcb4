"""The embedded policy: a Qwen3 / Qwen3-MoE decoder with Hugging Face parameter names.

One file, top to bottom: RMSNorm → rotary embedding → attention (GQA, q/k norm) → SwiGLU MLP
→ sparse MoE block (softmax top-k router, R3 forced routing) → decoder layer → model → LM head.
State-dict keys equal the keys of an HF checkpoint on disk (`model.layers.0.mlp.experts.3.up_proj.weight`
…), so weights move between this model, `transformers` and SGLang without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from axrl.model.config import ModelConfig
from axrl.model.exact import exact_attention, exact_linear, exact_silu


class KVCache(Protocol):
    """What attention needs from a KV cache: store this step's keys/values, return what to attend over."""

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class ActivationProbe(Protocol):
    """Explicit hook points of a forward, for mismatch attribution (replay/explain.py).

    `at(point, layer, x)` is called with the activation at each point and returns the tensor the
    forward continues with: `x` itself to observe, another tensor of the same shape and dtype to
    patch. Points (`axrl.model.probe_points`, in forward order): per decoder layer `layer` "in"
    (the residual stream entering it), "attn_norm", "attn" (after o_proj), "mid" (after the
    attention's residual add), "mlp_norm", then in MoE layers "router" (logits, rows flattened
    [B*S, E]), "topk_ids", "topk_weights" (slot order, [B*S, top_k]), "expert_out" ([B*S, top_k, H],
    before the routing weight), then "moe" (the MLP/MoE output before the add) and "out" (the
    layer's output); then "final" (after the final norm) and "logits", both with layer −1.
    The forward may modify `x` in place afterwards: copy what you keep. Without a probe the
    forward runs exactly as before (no extra ops); with one that returns `x` it computes the
    same bits.
    """

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        ...


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) with the exact variant of `axrl.model.exact`
    behind the `exact` switch (`set_exact`)."""

    exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return exact_linear(x, self.weight, self.bias)
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the scale, as HF does, so bf16 numerics match.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, S, head_dim] for integer positions [B, S]."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, D] by cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    exact = False  # `set_exact`: attention with `exact_attention`

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                kv_cache: KVCache | None) -> torch.Tensor:
        """mask: bool [B, 1, S, K], or None for plain causal attention over these S tokens."""
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, S, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        if self.exact:  # grouped-query attention inside, without repeating K/V
            if mask is None:  # the S new tokens over themselves, causally
                mask = causal_mask(None, B, S, x.device)
            out = exact_attention(q, k, v, mask, self.head_dim ** -0.5)
            return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # is_causal instead of an explicit mask lets SDPA pick its fused kernel (~2.5x faster on CPU).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and S > 1,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward; also one expert of the MoE block."""

    exact = False  # `set_exact`: a SiLU whose rounding does not depend on the element's place

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = exact_silu if self.exact else F.silu
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Softmax top-k router over SwiGLU experts.

    With `forced_experts` (R3, rollout routing replay) the experts are exactly those given; their
    weights are still the router's softmax probabilities at those indices, so gradients keep
    reaching the router through the chosen experts' logits. A row of −1 routes that token freely
    (partial R3: some tokens replayed, the others routed by the router).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None, probe: ActivationProbe | None = None,
                layer: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → (out [N, H], chosen expert indices [N, top_k]); `probe` sees the router
        logits as point "router" of `layer`."""
        logits = self.gate(x)
        if probe is not None:
            logits = probe.at("router", layer, logits)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if forced_experts is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = forced_experts.long()
            free = experts[:, 0] < 0
            if bool(free.any()):
                own = torch.topk(probs, self.top_k, dim=-1).indices
                experts = torch.where(free[:, None], own, experts)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        out = torch.zeros_like(x)
        if probe is not None:
            experts = probe.at("topk_ids", layer, experts)
            weights = probe.at("topk_weights", layer, weights)
            return self._probed_experts(x, out, experts, weights, probe, layer), experts
        # Loop over experts that received tokens; index_add_ on CPU is deterministic.
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == e)
            y = self.experts[e](x[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out, experts

    def _probed_experts(self, x: torch.Tensor, out: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        probe: ActivationProbe, layer: int) -> torch.Tensor:
        """The expert loop of `forward` with the "expert_out" point: each routed expert's output
        per (token, slot) is gathered into one tensor [N, top_k, H] the probe sees, then weighted
        and combined exactly as the unprobed loop does (same values, same index_add_ order)."""
        order = torch.unique(experts).tolist()
        ys: torch.Tensor | None = None
        for e in order:
            token_idx, slot = torch.where(experts == e)
            y = self.experts[e](x[token_idx])
            if ys is None:
                ys = y.new_zeros(*experts.shape, x.shape[-1])
            ys[token_idx, slot] = y
        if ys is None:
            return out
        ys = probe.at("expert_out", layer, ys)
        for e in order:
            token_idx, slot = torch.where(experts == e)
            y = ys[token_idx, slot] * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp: nn.Module = SparseMoeBlock(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                kv_cache: KVCache | None, forced_experts: torch.Tensor | None,
                probe: ActivationProbe | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if probe is not None:
            return self._probed(x, cos, sin, mask, kv_cache, forced_experts, probe)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), None
        B, S, H = h.shape
        forced = None if forced_experts is None else forced_experts.reshape(B * S, -1)
        out, experts = self.mlp(h.reshape(B * S, H), forced)
        return x + out.view(B, S, H), experts.view(B, S, -1)

    def _probed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                kv_cache: KVCache | None, forced_experts: torch.Tensor | None,
                probe: ActivationProbe) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with every layer point of `axrl.model.probe_points` (the same ops, in order)."""
        li = self.self_attn.layer_idx
        h = probe.at("attn_norm", li, self.input_layernorm(x))
        x = probe.at("mid", li, x + probe.at("attn", li, self.self_attn(h, cos, sin, mask, kv_cache)))
        h = probe.at("mlp_norm", li, self.post_attention_layernorm(x))
        if not self.is_moe:
            return x + probe.at("moe", li, self.mlp(h)), None
        B, S, H = h.shape
        forced = None if forced_experts is None else forced_experts.reshape(B * S, -1)
        out, experts = self.mlp(h.reshape(B * S, H), forced, probe, li)
        return x + probe.at("moe", li, out.view(B, S, H)), experts.view(B, S, -1)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None          # [B, S, V] (or the rows asked for)
    hidden: torch.Tensor                 # final-norm hidden states [B, S, H]
    routed_experts: torch.Tensor | None  # [B, S, L, top_k] int64, when requested on an MoE model


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row is real tokens followed only by padding. Then plain causal attention
    is exact for the real tokens: none of them can see a later (padded) position."""
    m = attention_mask.bool()
    return bool((m[:, 1:] <= m[:, :-1]).all())


def causal_mask(attention_mask: torch.Tensor | None, B: int, S: int, device: torch.device) -> torch.Tensor:
    """Boolean [B, 1, S, S] mask: causal, and keys masked where `attention_mask` [B, S] is 0."""
    mask = torch.ones(S, S, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, S, S)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
        # A query row with no visible key (left padding) would make SDPA emit NaN; let such
        # rows attend to themselves. Their outputs are padding and are never read.
        eye = torch.eye(S, dtype=torch.bool, device=device)[None, None]
        mask = mask | (eye & ~mask.any(-1, keepdim=True))
    return mask


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """The policy. `forward` serves training (full sequences) and inference (with a KV cache).

    `exact` (set with `axrl.model.exact.set_exact`): the batch- and position-invariant op set, so
    that a token's logits and routing are bitwise the same in any batch, in decode and teacher-forced."""

    exact = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        forced_experts: torch.Tensor | None = None,
        return_routing: bool = False,
        compute_logits: bool = True,
        probe: ActivationProbe | None = None,
    ) -> ModelOutput:
        """Run the decoder.

        input_ids [B, S]; position_ids default to 0..S-1; attention_mask [B, S] marks real tokens
        (right or left padding); `mask` overrides the attention mask entirely ([B, 1, S, K] bool,
        needed when a KV cache returns more keys than the S new tokens). forced_experts [B, S, L, top_k] replays routing (R3);
        its rows for dense layers are ignored. Routing is returned in the same layout. `probe`
        observes or patches the hook points of `ActivationProbe`.
        """
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if mask is None and attention_mask is not None and not is_right_padded(attention_mask):
            mask = causal_mask(attention_mask, B, S, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        routing: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            forced = None if forced_experts is None or not layer.is_moe else forced_experts[:, :, i]
            if probe is not None:
                x = probe.at("in", i, x)
            x, experts = layer(x, cos, sin, mask, kv_cache, forced, probe)
            if probe is not None:
                x = probe.at("out", i, x)
            if return_routing and self.config.is_moe:
                routing.append(experts if experts is not None
                               else torch.zeros(B, S, self.config.num_experts_per_tok, dtype=torch.long,
                                                 device=x.device))
        hidden = self.model.norm(x)
        if probe is not None:
            hidden = probe.at("final", -1, hidden)
        logits = self.lm_head(hidden) if compute_logits else None
        if probe is not None and logits is not None:
            logits = probe.at("logits", -1, logits)
        return ModelOutput(
            logits=logits,
            hidden=hidden,
            routed_experts=torch.stack(routing, dim=2) if routing else None,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: Qwen3ForCausalLM, seed: int) -> None:
    """HF-style init (normal(0, initializer_range), norms at 1) from a private generator, so the
    same seed gives the same weights regardless of global RNG state."""
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
