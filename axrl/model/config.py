"""Model configuration: a 1:1 image of Hugging Face's Qwen3 / Qwen3-MoE `config.json`."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, named exactly as in HF's `config.json`.

    `num_experts == 0` gives the dense Qwen3 architecture; otherwise every layer whose index is
    not in `mlp_only_layers` (and fits `decoder_sparse_step`) is a sparse MoE layer.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"model config field '{name}': {why}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, f"must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", "must divide num_attention_heads "
                      f"({self.num_attention_heads} % {self.num_key_value_heads} != 0)")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even for rotary embeddings")
        if self.num_experts < 0:
            raise bad("num_experts", "must be >= 0 (0 = dense model)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad("num_experts_per_tok", f"must be in [1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", "must be positive for an MoE model")
        if self.num_experts > 65535:
            raise bad("num_experts", "at most 65535 (routing is traced as uint16)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a sparse MoE block (HF's rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def routing_shape(self) -> tuple[int, int, int] | None:
        """``(layers, top_k, num_experts)`` of the expert routing recorded per token; None for a
        dense model.

        ``layers`` is every decoder layer, dense ones (``mlp_only_layers``, ``decoder_sparse_step``)
        included with zero rows, not only the MoE layers: that is the layout the model's forward
        returns (``Qwen3ForCausalLM(return_routing=True)``), the engines send (SGLang's
        ``[tokens, num_hidden_layers, top_k]``), R3 replays and the trace's ``/routing`` holds.
        """
        if not self.is_moe:
            return None
        return self.num_hidden_layers, self.num_experts_per_tok, self.num_experts

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` contents; loadable by `transformers` and by SGLang."""
        d: dict[str, Any] = {
            "architectures": [_MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "torch_dtype": "float32",
            # transformers >= 5 reads rope_parameters; SGLang and older transformers read rope_theta.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        d.update(asdict(self))
        if not self.is_moe:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                d.pop(key)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse an HF `config.json` dict of a Qwen3 or Qwen3-MoE model."""
        arch = d.get("architectures")
        if arch is not None and (not isinstance(arch, list) or not set(arch) <= set(SUPPORTED_ARCHITECTURES)):
            raise ValueError(f"config.json 'architectures' is {arch!r}; AxRL's embedded model (trainer, engine, "
                             f"trace) supports {list(SUPPORTED_ARCHITECTURES)}")
        model_type = d.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"config.json 'model_type' is {model_type!r}; AxRL's embedded model "
                             f"supports {sorted(_MODEL_TYPES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json 'hidden_act' is {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("attention_bias"):
            raise ValueError("config.json 'attention_bias' is true; only bias-free attention is supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"config.json rope type {rope.get('rope_type')!r}: only 'default' RoPE is supported")
        kw: dict[str, Any] = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
        if model_type == "qwen3_moe":
            kw["num_experts"] = int(d.get("num_experts", d.get("num_local_experts", 0)))
        else:
            kw["num_experts"] = 0
        if "head_dim" not in kw:
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        kw["mlp_only_layers"] = list(kw.get("mlp_only_layers") or [])
        missing = [f.name for f in fields(cls)
                   if f.default is MISSING and f.default_factory is MISSING and f.name not in kw]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing}")
        return cls(**kw)



PRESETS: dict[str, dict[str, Any]] = {
    # ~2M parameters: fast enough to train an agent on a 2-core CPU in minutes.
    "tiny-moe": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=256, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                     max_position_embeddings=4096),
    "tiny-dense": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=384, num_experts=0,
                       max_position_embeddings=4096),
    # Smallest sensible shapes, for unit tests.
    "micro-moe": dict(vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def preset_config(name: str, **overrides: Any) -> ModelConfig:
    """A `ModelConfig` from a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
