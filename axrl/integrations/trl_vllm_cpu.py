"""TRL's colocated vLLM on vLLM's CPU build: re-pack the MoE experts after every weight push.

TRL's colocate mode (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``) pushes the policy into
the engine before each generation from new weights, one parameter per
``model.load_weights([(name, tensor)])`` call (trl 1.16, ``VLLMGeneration.sync_weights``). On
vLLM's CPU build the MoE experts kernel re-packs the stacked expert tensors into its own layout
once, when the model is first loaded; ``load_weights`` writes the new experts in vLLM's plain
layout and nothing re-packs them, so from the first push on the kernel computes with bytes in the
wrong layout and the engine samples from a near-uniform distribution (measured with
``bench/trl_vllm_colocate.py``: mean |vLLM − trainer| 5.3 nats a token; docs/import.md). Every
other tensor class loads correctly there.

`repack_after_sync(trainer)` wraps the trainer's ``vllm_generation.sync_weights`` so that after
TRL's own push the kernel's load-time re-packing runs again on each experts module that holds
exactly the trainer's experts in the plain layout (`repack_experts`; a module already re-packed,
or holding anything else, is never written). `record_grpo(..., repack_vllm_cpu_experts=True)`
installs it; without it, `record_grpo` warns when the engine needs it. TRL's server mode
(``trl vllm-serve``) is not covered: its push happens in the server's process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from axrl.inference.vllm.checksum_extension import plain_experts_from, repack_experts, repacks_experts

log = logging.getLogger("axrl.trl")
__all__ = ["colocated_model", "needs_expert_repack", "repack_after_sync"]


def colocated_model(trainer: Any) -> torch.nn.Module | None:
    """The model TRL's colocated vLLM engine computes with (TRL's own path to it), or None when the
    trainer has no colocated engine."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "mode", None) != "colocate":
        return None
    try:
        return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError:   # another vLLM/TRL layout: the engine cannot be seen from here
        return None


def needs_expert_repack(trainer: Any) -> bool:
    """Whether the trainer's colocated engine re-packs its experts at load (vLLM's CPU build), so
    that TRL's weight push leaves them unpacked."""
    model = colocated_model(trainer)
    return model is not None and repacks_experts(model)


def repack_after_sync(trainer: Any) -> dict[str, int]:
    """Wrap ``trainer.vllm_generation.sync_weights`` (module doc); returns the running counts of
    experts modules `repacked`, `already_packed` and `neither` over every push, updated in place."""
    model = colocated_model(trainer)
    if model is None:
        raise ValueError("repack_after_sync: the trainer has no colocated vLLM engine "
                         "(GRPOConfig(use_vllm=True, vllm_mode='colocate'))")
    generation = trainer.vllm_generation
    push = generation.sync_weights
    totals = {"repacked": 0, "already_packed": 0, "neither": 0}

    def sync_weights(*args: Any, **kwargs: Any) -> Any:
        out = push(*args, **kwargs)
        params = {name: p.detach() for name, p in trainer.model.named_parameters()}
        counts = repack_experts(model, plain_experts_from(params))
        for key, value in counts.items():
            totals[key] += value
        if counts["neither"]:
            log.warning("vLLM's CPU build: %d experts module(s) hold neither the trainer's experts nor their "
                        "re-packing after TRL's weight push; they were left as they are (names differ from "
                        "the trainer's parameters?)", counts["neither"])
        generation.llm.reset_prefix_cache()  # nothing was generated since TRL's reset; kept for safety
        return out

    generation.sync_weights = sync_weights
    return totals
