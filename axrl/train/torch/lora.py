"""LoRA adapters on the embedded `Qwen3ForCausalLM` (`train.lora`, docs/algorithms.md "LoRA").

Each target `nn.Linear` (HF name `…q_proj`, `…experts.3.up_proj`, …) gets a rank-r pair A [r, in],
B [out, r]; its output becomes `W x + (alpha / r) · B A dropout(x)`, added by a forward hook, so the
model's modules, parameter names and `state_dict` stay the base model's (HF names, load/save
unchanged). All base weights are frozen; only A and B train. B starts at zero (step 0 is the base
model, bit for bit); A draws from its own seeded generator (same seed ⇒ same bits, the global RNG
is left alone). The engine, the trace fingerprint and `export_hf` see the merged weights
`W + (alpha / r) · B A` (`merged`), so they run unchanged.

Adapter names follow PEFT (`{module}.lora_A.weight`, `{module}.lora_B.weight`): they key the
optimizer state, checkpoints and the PEFT export.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

# `train.lora.targets` groups → the projections they adapt. The MoE router (`mlp.gate`), the
# embeddings, the norms and the LM head are never adapted.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),          # every layer's attention
    "mlp": ("gate_proj", "up_proj", "down_proj"),              # the dense layers' SwiGLU MLP
    "experts": ("gate_proj", "up_proj", "down_proj"),          # each MoE expert's SwiGLU (one pair per expert)
}
ADAPTER_KEYS = (".lora_A.weight", ".lora_B.weight")


class LoRAConfig(BaseModel):
    """`train.lora` (this type is the YAML section): rank, scale (`alpha / rank`), dropout on the
    adapter's input, and the target groups."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, description="r: the adapters' inner dimension")
    alpha: float = Field(16.0, gt=0, description="the adapter output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    targets: tuple[str, ...] = Field(tuple(LORA_TARGETS), min_length=1,
                                     description="what gets adapters: attn (q/k/v/o_proj), mlp (dense layers' "
                                                 "gate/up/down_proj), experts (each MoE expert's gate/up/down_proj)")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown target(s) {unknown}; choose from {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets repeat a name: {list(targets)}")
        return targets

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_group(name: str) -> str | None:
    """The `LORA_TARGETS` group of the module named `name` (HF name), or None when none adapts it."""
    parent, _, leaf = name.rpartition(".")
    if parent.endswith(".self_attn"):
        group = "attn"
    elif ".experts." in parent:
        group = "experts"
    elif parent.endswith(".mlp"):
        group = "mlp"
    else:
        return None
    return group if leaf in LORA_TARGETS[group] else None


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The model's `nn.Linear`s in `targets`, by HF module name, in module order."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and target_group(name) in targets}


class LoRAAdapters:
    """The adapters of one model: attaching them freezes every base weight and hooks every target."""

    def __init__(self, model: nn.Module, config: LoRAConfig, seed: int) -> None:
        self.config = config
        self.modules = target_modules(model, config.targets)
        if not self.modules:
            raise ValueError(f"train.lora.targets {list(config.targets)}: this model has none of these modules "
                             "('experts' needs an MoE model, 'mlp' dense layers)")
        model.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        self.A: dict[str, nn.Parameter] = {}
        self.B: dict[str, nn.Parameter] = {}
        for name, linear in self.modules.items():
            w = linear.weight
            # PEFT's init (kaiming-uniform with a=√5: U(±1/√in)), drawn in fp32 on the CPU from our
            # own generator so the bits do not depend on device, dtype or the global RNG.
            bound = 1.0 / math.sqrt(linear.in_features)
            a = torch.empty(config.rank, linear.in_features).uniform_(-bound, bound, generator=gen)
            self.A[name] = nn.Parameter(a.to(w.device, w.dtype))
            self.B[name] = nn.Parameter(torch.zeros(linear.out_features, config.rank, dtype=w.dtype, device=w.device))
        self._handles = [linear.register_forward_hook(self._hook(name)) for name, linear in self.modules.items()]

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        A, B, scale, p = self.A[name], self.B[name], self.config.scale, self.config.dropout

        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            x = F.dropout(args[0], p, module.training) if p > 0 else args[0]
            # PEFT's order of operations: base + B(A(x)) · scale.
            return out + F.linear(F.linear(x, A), B) * scale
        return hook

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(PEFT name, parameter) of every A and B, in module order: the trainable parameters."""
        return [(f"{name}{key}", t) for name in self.modules
                for key, t in zip(ADAPTER_KEYS, (self.A[name], self.B[name]))]

    def delta(self, name: str) -> torch.Tensor:
        """(alpha / r) · B A of module `name`: what merging adds to its weight."""
        with torch.no_grad():
            return (self.B[name] @ self.A[name]) * self.config.scale

    def merged(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named `weights` with every adapted `{module}.weight` replaced by W + (alpha / r) · B A."""
        out = dict(weights)
        for name in self.modules:
            out[f"{name}.weight"] = weights[f"{name}.weight"] + self.delta(name)
        return out

    @contextlib.contextmanager
    def merged_into_model(self) -> Iterator[None]:
        """Within the block the base weights hold W + (alpha / r) · B A (to save the merged model; a
        forward in it would add the adapters twice), restored bit for bit afterwards."""
        saved = {name: linear.weight.data for name, linear in self.modules.items()}
        try:
            for name, linear in self.modules.items():
                linear.weight.data = saved[name] + self.delta(name)
            yield
        finally:
            for name, linear in self.modules.items():
                linear.weight.data = saved[name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of A and B under their PEFT names."""
        return {name: p.detach().clone() for name, p in self.named_parameters()}

    def check(self, state: Mapping[str, torch.Tensor], source: str) -> None:
        """Raise ValueError unless `state` has exactly these adapters' names and shapes."""
        params = dict(self.named_parameters())
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(f"{source}: LoRA adapters do not match train.lora (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{source}: '{name}' has shape {tuple(state[name].shape)}, train.lora expects "
                                 f"{tuple(p.shape)} (a different rank?)")

    def load_state_dict(self, state: Mapping[str, torch.Tensor], source: str) -> None:
        """Copy `state_dict` output back in place, checked (`check`) first."""
        self.check(state, source)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name].to(p.dtype))

    def owns(self, key: str) -> bool:
        """Whether `key` of a checkpoint's model weights names an adapter (not a base weight)."""
        return key.endswith(ADAPTER_KEYS)


PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


def peft_adapter_config(adapters: LoRAAdapters, base_model: str | None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for these adapters: the adapted modules listed by full HF name."""
    c = adapters.config
    # PEFT refuses dropout on fused experts; dropout only acts in training, so inference is unchanged.
    experts = any(target_group(name) == "experts" for name in adapters.modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": c.rank, "lora_alpha": c.alpha, "lora_dropout": 0.0 if experts else c.dropout,
            "target_modules": list(adapters.modules),
            "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False}


def export_peft(adapters: LoRAAdapters, directory: str | Path, base_model: str | None = None, *,
                moe: bool = False) -> Path:
    """Write the adapters alone in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`,
    keys `base_model.model.{module}.lora_A.weight`), loadable with `PeftModel.from_pretrained` on the
    base model. Expert adapters load too: PEFT converts per-expert adapters onto transformers' fused
    experts (`mlp.experts.gate_up_proj`). That conversion takes every `gate/up/down_proj` of an MoE
    model (`moe`) for an expert's, so the dense MLP layers of an MoE model (`mlp_only_layers`) cannot
    be exported this way."""
    dense = [name for name in adapters.modules if target_group(name) == "mlp"]
    if moe and dense:
        raise ValueError(f"the run adapts the dense MLP of an MoE model ({dense[0]}, … {len(dense)} modules) and "
                         "PEFT maps every gate/up/down_proj of a transformers MoE model onto its fused experts, so "
                         "it would load them into the wrong place: export the merged model instead (without "
                         "--adapter-only), or train with train.lora.targets: [attn, experts]")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name}": t.detach().contiguous().cpu() for name, t in adapters.named_parameters()}
    save_file(tensors, str(out / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    config = peft_adapter_config(adapters, base_model)
    (out / PEFT_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out
