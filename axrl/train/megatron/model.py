"""Build megatron-core's `GPTModel` (local layer spec: no Transformer Engine, no Apex) with the
architecture of an axrl/Hugging Face Qwen3 or Qwen3-MoE `ModelConfig`."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from axrl.model import ModelConfig


@dataclass(frozen=True)
class ParallelSizes:
    """Parallel layout of one process group, Megatron's: world = tensor_parallel × data_parallel
    (no pipeline / context parallel); expert_parallel divides the world size."""

    tensor_parallel: int = 1
    expert_parallel: int = 1
    sequence_parallel: bool = False
    data_parallel: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def expert_tensor_parallel(self) -> int:
        # Experts are never TP-sliced: gloo's all-gather cannot take the uneven token counts an
        # expert-TP dispatch gathers. With EP < world size the experts are replicated over
        # `expert_data_parallel` ranks, each routing its own tokens.
        return 1

    @property
    def expert_data_parallel(self) -> int:
        return self.world_size // self.expert_parallel


def transformer_config(cfg: ModelConfig, sizes: ParallelSizes, *, dispatcher: str = "alltoall",
                       params_dtype: torch.dtype = torch.float32, bf16: bool = False,
                       routing_replay: bool = True) -> Any:
    """The `TransformerConfig` equivalent to `cfg`.

    Qwen3-MoE routes with softmax over all experts, top-k, then (norm_topk_prob) renormalises
    the k probabilities; Megatron's `pre_softmax=False` (top-k of logits, softmax over the k) is
    the same function, `pre_softmax=True` the un-normalised variant. No aux loss, no capacity
    drop, no biases, no dropout: exactly the HF forward.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if cfg.is_moe:
        moe = dict(
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
            moe_layer_freq=[1 if cfg.is_moe_layer(i) else 0 for i in range(cfg.num_hidden_layers)],
            moe_enable_routing_replay=routing_replay, moe_router_dtype="fp32",
            expert_model_parallel_size=sizes.expert_parallel,
            expert_tensor_parallel_size=sizes.expert_tensor_parallel,
        )
    with warnings.catch_warnings():
        # 0.16.1 warns about its own default cuda_graph_scope on every construction.
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return TransformerConfig(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
            kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
            normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
            hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=sizes.tensor_parallel, sequence_parallel=sizes.sequence_parallel,
            use_cpu_initialization=True, perform_initialization=False,
            params_dtype=params_dtype, bf16=bf16, init_method_std=cfg.initializer_range,
            **moe,
        )


def build_gpt_model(cfg: ModelConfig, sizes: ParallelSizes, **kwargs: Any) -> torch.nn.Module:
    """A `GPTModel` on this rank (parallel state must be initialised), weights uninitialised.

    Logits are gathered over TP (`parallel_output=False`): the backend computes logprobs over the
    full vocabulary on every rank, as the embedded backend does.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tc = transformer_config(cfg, sizes, **kwargs)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, pre_process=True, post_process=True,
                    parallel_output=False, share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                    position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(cfg.rope_theta)
                    if float(cfg.rope_theta).is_integer() else cfg.rope_theta)
    _router_outside_autocast(model)
    return model


def _router_outside_autocast(model: torch.nn.Module) -> None:
    """Keep router logits in fp32 under autocast (dtype=bfloat16 runs the forward under
    autocast, as the embedded backend does). Megatron's router gating function has no autocast
    declaration: autocast would silently run its fp32 matmul in bf16 and its backward would then
    mix dtypes. (The embedded model's gate matmul does run in bf16 under autocast; its softmax is
    fp32. bf16 parity between the backends is therefore approximate, as it is anyway.)"""
    for module in model.modules():
        if hasattr(module, "gating") and hasattr(module, "router_replay"):
            inner = module.gating

            def gating(x: torch.Tensor, _inner: Any = inner) -> torch.Tensor:
                with torch.autocast(x.device.type, enabled=False):
                    return _inner(x)

            module.gating = gating


@contextlib.contextmanager
def rope_positions(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Run the block with RoPE at the given per-token positions [S] instead of 0..S-1.

    megatron-core's `GPTModel` builds its rotary embedding from the sequence length alone and
    ignores `position_ids` under RoPE (0.16.1, `GPTModel._preprocess`). A prefix-merged forward
    (`axrl/train/prefix_tree.py`) needs each slot rotated by its depth on its own path, so the
    model's `RotaryEmbedding` returns its own table indexed by `positions` for this call (with
    sequence parallel the table covers the whole sequence, as Megatron's does)."""
    rope = model.rotary_pos_emb
    table = rope.get_emb(int(positions.max()) + 1)  # [P, 1, 1, dim], Megatron's own computation
    rope.forward = lambda *args, **kwargs: table[positions]
    try:
        yield
    finally:
        del rope.forward  # back to the class's (cached) forward
