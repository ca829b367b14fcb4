"""Deep diagnostics of one optimizer batch on an embedded `Qwen3ForCausalLM` (`TrainBackend.inspect`).

Everything is observed, never changed: forward hooks read detached copies and per-sample
gradients come from `torch.autograd.grad`, which leaves `.grad` alone, so an inspection between
two steps of a bitwise re-execution does not disturb it. Each sample is run on its own (one
forward + backward per sample): per-sample gradients need that anyway, and the activation norms
then come from the same forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from axrl.model import Qwen3ForCausalLM
from axrl.train.micro_batch import next_token_logprobs, pad_micro_batch, unpad
from axrl.train.protocol import Inspection, LossContext, LossFn, PackedBatch, R3Scope


class _Hooks:
    """Forward hooks on the embeddings, every decoder layer, the final norm and the MoE blocks."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        inner = model.model
        layers = list(inner.layers)
        self.points: list[tuple[str, nn.Module]] = ([("embed_tokens", inner.embed_tokens)]
                                                    + [(f"layers.{i}", layer) for i, layer in enumerate(layers)]
                                                    + [("norm", inner.norm)])
        self.moe_layers = [i for i, layer in enumerate(layers) if layer.is_moe]
        E = model.config.num_experts
        self.router_tokens = torch.zeros(len(self.moe_layers), max(E, 0), dtype=torch.int64)
        self.router_entropy_sum = torch.zeros(len(self.moe_layers), dtype=torch.float64)
        self.router_count = torch.zeros(len(self.moe_layers), dtype=torch.float64)
        self.real: torch.Tensor | None = None       # bool [B, S]: real (non-padding) positions
        self.norms: list[torch.Tensor | None] = [None] * len(self.points)
        self._handles = [module.register_forward_hook(self._activation(a)) for a, (_, module) in enumerate(self.points)]
        for j, i in enumerate(self.moe_layers):
            block = layers[i].mlp
            self._handles.append(block.register_forward_hook(self._experts(j)))
            self._handles.append(block.gate.register_forward_hook(self._gate(j)))

    def _activation(self, a: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            x = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                self.norms[a] = x.detach()[self.real].float().norm(dim=-1).cpu()  # [T_real], packed order
        return hook

    def _experts(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            experts = output[1].detach()[self.real.reshape(-1)]
            counts = torch.bincount(experts.reshape(-1).cpu(), minlength=self.router_tokens.shape[1])
            self.router_tokens[j] += counts[: self.router_tokens.shape[1]]
        return hook

    def _gate(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            with torch.no_grad():
                logp = torch.log_softmax(output.detach()[self.real.reshape(-1)].float(), dim=-1)
                ent = -(logp.exp() * logp).sum(-1)
            self.router_entropy_sum[j] += float(ent.double().sum())
            self.router_count[j] += ent.numel()
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def inspect_model(model: Qwen3ForCausalLM, batch: PackedBatch, loss_fn: LossFn, *, r3: R3Scope | None,
                  autocast_bf16: bool = False, params: list[tuple[str, torch.Tensor]] | None = None) -> Inspection:
    """Activation norms, router load/entropy and per-sample gradients of `batch` (one optimizer
    batch, old logprobs set) under `loss_fn`, normalised as the whole batch (`LossContext`).
    `params`: the (name, tensor) trained (default: the model's own trainable parameters; LoRA
    adapters live outside the model)."""
    device = next(model.parameters()).device
    if params is None:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ctx = LossContext.of(batch)
    hooks = _Hooks(model)
    T, N = batch.num_tokens, batch.num_samples
    act = torch.full((T, len(hooks.points)), float("nan"), dtype=torch.float32)
    grads: list[list[torch.Tensor | None]] = []
    was_training = model.training
    model.train()
    try:
        offsets = batch.offsets.tolist()
        for i in range(N):
            mb = batch.select([i])
            pm = pad_micro_batch(mb, with_routing=r3 is not None, device=device, scope=r3)
            hooks.real = pm.attention_mask.bool()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                out = model(pm.input_ids, attention_mask=pm.attention_mask, forced_experts=pm.forced_experts)
            for a, norms in enumerate(hooks.norms):
                if norms is not None and norms.numel() == mb.num_tokens:
                    act[offsets[i]:offsets[i + 1], a] = norms
            lp, ent = next_token_logprobs(out.logits, pm.input_ids, mb.temperature)
            loss, _ = loss_fn(unpad(lp, pm.rows, pm.cols), unpad(ent, pm.rows, pm.cols), mb, ctx)
            if loss.requires_grad:
                grads.append(list(torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)))
            else:
                grads.append([None] * len(params))
    finally:
        hooks.remove()
        model.train(was_training)
    # The batch's gradient is the sum of the samples' (each loss is normalised by batch-wide counts).
    total = [None if all(g[k] is None for g in grads) else
             torch.stack([g[k].detach().double() for g in grads if g[k] is not None]).sum(0)
             for k in range(len(params))]
    total_sq = sum(float(t.pow(2).sum()) for t in total if t is not None)
    norm = torch.full((N,), float("nan"), dtype=torch.float64)
    cosine = torch.full((N,), float("nan"), dtype=torch.float64)
    for i, g in enumerate(grads):
        sq = dot = 0.0
        for gk, tk in zip(g, total):
            if gk is not None:
                gk = gk.detach().double()
                sq += float(gk.pow(2).sum())
                dot += float((gk * tk).sum())
        norm[i] = sq ** 0.5
        denom = (sq * total_sq) ** 0.5
        if denom > 0:
            cosine[i] = dot / denom
    with torch.no_grad():
        entropy = hooks.router_entropy_sum / hooks.router_count.clamp(min=1)
    return Inspection(
        activation_names=[name for name, _ in hooks.points], activation_norm=act,
        moe_layers=hooks.moe_layers, router_tokens=hooks.router_tokens, router_entropy=entropy,
        sample_grad_norm=norm, sample_grad_cosine=cosine, param_names=[n for n, _ in params],
        param_grad_norm=torch.tensor([0.0 if t is None else float(t.norm()) for t in total], dtype=torch.float64))
