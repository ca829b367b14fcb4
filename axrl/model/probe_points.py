"""The probe-point vocabulary: the named activations of one forward, in forward order.

One vocabulary for every engine and trainer (the embedded engine, the torch trainer, SGLang, vLLM):
`axrl-debug bisect` walks these points in this order, `doctor` findings name them as evidence
("layer 3, op expert_out, expert 5"), and `axrl.model.ActivationProbe` is called at them by
`Qwen3ForCausalLM.forward` (layer points with the 0-based decoder layer index, the model-level
points with layer −1). The points `in`, `mid`, `router`, `out`, `final` and `logits` are the
original hook points of mismatch attribution (replay/explain.py) and keep their meaning.

Shapes as a probe sees them in the model's forward ([B, S, …] or flattened rows [B*S, …]):
layer points carry one row per token; `expert_out` one row per (token, slot): [B*S, top_k, H];
`topk_ids` is int64 [B*S, top_k]; `logprobs` is not a model op (the trainer's loss and the
engine's sampler apply the log-softmax) and is derived from `logits` by whoever compares.
"""

from __future__ import annotations

#: Per decoder layer, in forward order: (name, meaning).
LAYER_POINTS: tuple[tuple[str, str], ...] = (
    ("in", "residual stream entering the layer"),
    ("attn_norm", "input_layernorm output (the attention's input)"),
    ("attn", "self-attention output after o_proj, before the residual add"),
    ("mid", "residual stream after the attention's add"),
    ("mlp_norm", "post_attention_layernorm output (the MLP's / MoE's input)"),
    ("router", "MoE router logits, rows [N, E]"),
    ("topk_ids", "selected experts per token, in slot order [N, top_k]"),
    ("topk_weights", "routing weights as used by the combine, in slot order [N, top_k]"),
    ("expert_out", "each routed expert's output per token and slot, before its weight [N, top_k, H]"),
    ("moe", "the combined MLP / MoE output, before the residual add"),
    ("out", "the layer's output (residual stream after the MLP's add)"),
)

#: After the last layer (layer −1), in forward order.
MODEL_POINTS: tuple[tuple[str, str], ...] = (
    ("final", "after the final norm"),
    ("logits", "LM head output [N, V]"),
    ("logprobs", "full-vocabulary log-softmax of the logits (at the sampling temperature)"),
)

#: Every point name, in forward order.
POINTS: tuple[str, ...] = tuple(n for n, _ in LAYER_POINTS) + tuple(n for n, _ in MODEL_POINTS)
#: name → one-line meaning.
MEANING: dict[str, str] = dict(LAYER_POINTS + MODEL_POINTS)
#: Points that exist only in MoE layers.
MOE_POINTS: frozenset[str] = frozenset({"router", "topk_ids", "topk_weights", "expert_out"})


def forward_order(num_layers: int, moe_layers: set[int] | frozenset[int]) -> list[tuple[int, str]]:
    """Every (layer, point) of a model with `num_layers` decoder layers, in forward order; the
    MoE-only points only in `moe_layers`; then the model-level points with layer −1."""
    out = [(layer, name) for layer in range(num_layers) for name, _ in LAYER_POINTS
           if name not in MOE_POINTS or layer in moe_layers]
    return out + [(-1, name) for name, _ in MODEL_POINTS]


def check_point(name: str) -> str:
    """`name` if it is a probe point, else a ValueError listing the vocabulary."""
    if name not in MEANING:
        raise ValueError(f"unknown probe point {name!r}; the points are: {', '.join(POINTS)}")
    return name
