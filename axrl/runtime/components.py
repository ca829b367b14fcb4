"""Build a run's components from its config: the one place that maps config sections onto
constructors.

Used by the loop (`axrl train`) and by replay, which must build the trainer exactly as training
did — so replay imports this module, never the loop.
"""

from __future__ import annotations

import torch

from axrl.config import Config
from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import InferenceEngine
from axrl.model import Qwen3ForCausalLM, build_model, load_hf, load_weights_into, preset_config
from axrl.tokenizer import Tokenizer
from axrl.train import TorchBackend, TorchBackendConfig
from axrl.train.protocol import TrainBackend


def make_tokenizer(cfg: Config) -> Tokenizer:
    """The run's tokenizer and chat template."""
    return Tokenizer.default()


def initial_model(cfg: Config, tokenizer: Tokenizer) -> Qwen3ForCausalLM:
    """The policy before any training: `model.path` loaded, or a random-init `model.preset`."""
    dtype = getattr(torch, cfg.model.dtype)
    if cfg.model.path:
        return load_hf(cfg.model.path, dtype=dtype)
    model_cfg = preset_config(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return build_model(model_cfg, seed=cfg.model.init_seed, dtype=dtype)


def make_train_backend(cfg: Config, tokenizer: Tokenizer, *, compute_dtype: str | None = None) -> TrainBackend:
    """The RL trainer of a run, before any state is loaded (replay builds it the same way).

    `compute_dtype` ("float32" | "bfloat16") overrides the forward's compute dtype (a replay
    what-if); the weights, gradients and optimizer state keep the model's dtype.
    """
    model = initial_model(cfg, tokenizer)
    t = cfg.train
    common = dict(
        lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=cfg.steps * t.updates_per_step,
        micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed, num_threads=cfg.runtime.threads,
        deterministic=cfg.runtime.deterministic)
    if compute_dtype is not None:
        common["dtype"] = compute_dtype
    if t.backend == "megatron":
        # Imported here: `import axrl` and the torch path never import megatron-core (2-6 s).
        from axrl.train.megatron import MegatronBackend, MegatronBackendConfig

        m = t.megatron
        return MegatronBackend(model, MegatronBackendConfig(
            **common, tensor_parallel=m.tensor_parallel, expert_parallel=m.expert_parallel,
            sequence_parallel=m.sequence_parallel, moe_dispatcher=m.moe_dispatcher,
            data_parallel=m.data_parallel), tokenizer=tokenizer)
    return TorchBackend(model, TorchBackendConfig(**common), tokenizer=tokenizer)


def make_engine(cfg: Config, backend: TrainBackend, tokenizer: Tokenizer) -> InferenceEngine:
    """The rollout engine of a run, holding the trainer's current weights."""
    if cfg.rollout.engine == "sglang":
        # Launches (or connects to) SGLang / `axrl serve` servers holding an exported copy of the model.
        from axrl.inference.sglang.factory import build_sglang_engine

        return build_sglang_engine(cfg, backend, tokenizer)
    return make_embedded_engine(cfg, backend, tokenizer)


def make_embedded_engine(cfg: Config, backend: TrainBackend, tokenizer: Tokenizer) -> EmbeddedEngine:
    """An in-process engine with its own copy of the trainer's weights, as a remote server would
    hold; weight sync copies into it."""
    model = Qwen3ForCausalLM(backend.model_config).to(getattr(torch, cfg.model.dtype))
    load_weights_into(model, dict(backend.named_weights()), source="the trainer's weights")
    return EmbeddedEngine(model.eval(), max_batch_size=cfg.rollout.max_batch_size,
                          max_seq_len=cfg.rollout.max_context_len, eos_token_id=tokenizer.eos_token_id)
