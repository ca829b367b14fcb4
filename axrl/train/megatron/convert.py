"""Weights between the Hugging Face layout (what the engine, `export_hf` and the embedded model
use) and megatron-core's `GPTModel` layout, and Megatron's tensor/expert-parallel sharding.

Three layouts:
- HF: `model.layers.{i}.self_attn.q_proj.weight`, separate q/k/v, gate/up/down, experts by id.
- full Megatron (`to_megatron`): unsharded GPTModel names; q/k/v fused into `linear_qkv`
  grouped per KV head ([q heads of group g; k_g; v_g] for each g), gate/up fused into
  `linear_fc1` ([gate; up]); experts under their *global* id.
- rank-local Megatron (`shard`): what one rank's GPTModel holds — TP slices (column-parallel
  weights on dim 0, row-parallel on dim 1, `linear_fc1` sliced gate and up separately) and only
  this rank's experts, renumbered from 0.

All conversions are exact copies (no arithmetic), so HF → Megatron → HF is bitwise identity.
"""

from __future__ import annotations

import re

import torch

from axrl.model import ModelConfig

EXPERT_NAME = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(megatron name, hf name) pairs that copy 1:1 in layer i."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    pairs = [(m + "input_layernorm.weight", h + "input_layernorm.weight"),
             (m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"),
             (m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"),
             (m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight"),
             (m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight")]
    if cfg.is_moe_layer(i):
        pairs.append((m + "mlp.router.weight", h + "mlp.gate.weight"))
        for e in range(cfg.num_experts):
            pairs.append((m + f"mlp.experts.local_experts.{e}.linear_fc2.weight", h + f"mlp.experts.{e}.down_proj.weight"))
    else:
        pairs.append((m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight"))
    return pairs


def _fc1_pairs(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(megatron linear_fc1 name, hf prefix holding gate_proj/up_proj) of layer i."""
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    if cfg.is_moe_layer(i):
        return [(m + f"experts.local_experts.{e}.linear_fc1.weight", h + f"experts.{e}.") for e in range(cfg.num_experts)]
    return [(m + "linear_fc1.weight", h)]


def to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig, *, output_layer: bool = True) -> dict[str, torch.Tensor]:
    """HF-named weights → full (unsharded) Megatron-named weights (`output_layer` False: without
    the LM head, as the critic's value model has none)."""
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if output_layer and not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        h = f"model.layers.{i}.self_attn."
        q = hf[h + "q_proj.weight"].view(nkv, nq // nkv * d, -1)
        k = hf[h + "k_proj.weight"].view(nkv, d, -1)
        v = hf[h + "v_proj.weight"].view(nkv, d, -1)
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(
            (nq + 2 * nkv) * d, -1)
        out.update({m: hf[n] for m, n in _layer_names(cfg, i)})
        out.update({m: torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]) for m, p in _fc1_pairs(cfg, i)})
    return out


def to_hf(mg: dict[str, torch.Tensor], cfg: ModelConfig, *, output_layer: bool = True) -> dict[str, torch.Tensor]:
    """Full Megatron-named weights → HF-named weights (tied lm_head omitted, as HF does;
    `output_layer` False: a value model's, which has no LM head)."""
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
           "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    if output_layer and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"]
    for i in range(cfg.num_hidden_layers):
        qkv = mg[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].view(nkv, (nq // nkv + 2) * d, -1)
        q, k, v = qkv.split([nq // nkv * d, d, d], dim=1)
        h = f"model.layers.{i}.self_attn."
        out[h + "q_proj.weight"] = q.reshape(nq * d, -1).contiguous()
        out[h + "k_proj.weight"] = k.reshape(nkv * d, -1).contiguous()
        out[h + "v_proj.weight"] = v.reshape(nkv * d, -1).contiguous()
        out.update({n: mg[m] for m, n in _layer_names(cfg, i)})
        for m, p in _fc1_pairs(cfg, i):
            gate, up = mg[m].chunk(2, dim=0)
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate.contiguous(), up.contiguous()
    return out


# ---------------------------------------------------------------------------------- sharding
def split_rule(name: str) -> tuple[int | None, bool]:
    """(partition dim or None if replicated, whether it is a gated [gate; up] fc1)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or name.endswith("linear_qkv.weight"):
        return 0, False
    if name.endswith("linear_fc1.weight"):
        return 0, True
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return 1, False
    return None, False


def _slice(t: torch.Tensor, dim: int | None, gated: bool, rank: int, size: int) -> torch.Tensor:
    if dim is None or size == 1:
        return t
    if gated:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    return t.chunk(size, dim=dim)[rank].contiguous()


def _join(parts: list[torch.Tensor], dim: int | None, gated: bool) -> torch.Tensor:
    if dim is None or len(parts) == 1:
        return parts[0]
    if gated:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def shard(full: dict[str, torch.Tensor], *, num_experts: int, tp_rank: int, tp_size: int, ep_rank: int,
          ep_size: int, etp_rank: int, etp_size: int) -> dict[str, torch.Tensor]:
    """This rank's slice of full Megatron weights, named as in its GPTModel."""
    per_rank = num_experts // ep_size if num_experts else 0
    out = {}
    for name, t in full.items():
        dim, gated = split_rule(name)
        m = EXPERT_NAME.match(name)
        if m is None:
            out[name] = _slice(t, dim, gated, tp_rank, tp_size)
            continue
        e = int(m.group(2))
        if e // per_rank == ep_rank:
            out[f"{m.group(1)}{e % per_rank}{m.group(3)}"] = _slice(t, dim, gated, etp_rank, etp_size)
    return out


def global_expert_name(name: str, ep_rank: int, per_rank: int) -> str:
    """A rank-local expert parameter name under the expert's global id (other names unchanged)."""
    m = EXPERT_NAME.match(name)
    return name if m is None else f"{m.group(1)}{ep_rank * per_rank + int(m.group(2))}{m.group(3)}"


def hf_slices(name: str, t: torch.Tensor, cfg: ModelConfig, tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """A Megatron tensor (full Megatron name with global expert ids; possibly this rank's TP
    slice) → the slices of it that belong to each HF tensor, e.g. linear_qkv → q/k/v_proj parts,
    linear_fc1 → gate/up parts. The layouts are `to_hf`'s; every element lands in exactly one slice."""
    m = re.match(r"^decoder\.layers\.(\d+)\.", name)
    if m is not None and name.endswith("self_attention.linear_qkv.weight"):
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        group = nq // nkv
        q, k, v = t.view(nkv // tp_size, (group + 2) * d, -1).split([group * d, d, d], dim=1)
        h = f"model.layers.{m.group(1)}.self_attn."
        return [(h + "q_proj.weight", q), (h + "k_proj.weight", k), (h + "v_proj.weight", v)]
    if m is not None and name.endswith("linear_fc1.weight"):
        prefix = dict(_fc1_pairs(cfg, int(m.group(1))))[name]
        gate, up = t.chunk(2, dim=0)
        return [(prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up)]
    if m is not None:
        return [(dict(_layer_names(cfg, int(m.group(1))))[name], t)]
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight",
           "value_head.weight": "value_head.weight", "value_head.bias": "value_head.bias"}  # the critic's head
    return [(top[name], t)]


def unshard(parts: list[tuple[dict[str, torch.Tensor], dict[str, int]]], *, num_experts: int) -> dict[str, torch.Tensor]:
    """Inverse of `shard`: `parts` holds each rank's weights with its ranks/sizes
    (keys tp_rank, tp_size, ep_rank, ep_size, etp_rank, etp_size as given to `shard`)."""
    first = parts[0][1]
    per_rank = num_experts // first["ep_size"] if num_experts else 0
    dense: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for weights, r in parts:
        for name, t in weights.items():
            if EXPERT_NAME.match(name) is None:
                dense.setdefault(name, {})[r["tp_rank"]] = t
            else:
                experts.setdefault(global_expert_name(name, r["ep_rank"], per_rank), {})[r["etp_rank"]] = t
    out = {}
    for name, by_rank in list(dense.items()) + list(experts.items()):
        dim, gated = split_rule(name)
        out[name] = _join([by_rank[k] for k in sorted(by_rank)], dim, gated)
    return out
