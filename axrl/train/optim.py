"""The optimizer arithmetic both train backends share: the AdamW parameter groups, the learning-rate
schedule, gradient norms and clipping. Kept in one place so the backends step bit for bit alike."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from axrl.train.settings import BackendConfig


def adamw(params: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float], eps: float,
          weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `params` with weight decay on matrices only (not norms or biases), as Megatron does;
    single-tensor kernels (no foreach / fused), whose results do not depend on how tensors are batched."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps, foreach=False, fused=False)


def set_adam_hyper(optimizer: torch.optim.Optimizer, betas: tuple[float, float], eps: float,
                   weight_decay: float) -> None:
    """Set an `adamw` optimizer's betas, eps and (matrices-only) weight decay for its next step;
    the moments are kept, so a step may use other settings than the last (the Tinker API's)."""
    for i, group in enumerate(optimizer.param_groups):
        group["betas"], group["eps"] = betas, eps
        group["weight_decay"] = weight_decay if i == 0 else 0.0


def lr_at(config: BackendConfig, step: int) -> float:
    """Learning rate of update `step` (0-based count of applied updates).

    Linear warmup reaches `lr` at update warmup_steps-1 (the first update already gets
    lr/warmup_steps, not 0); then cosine/linear decay from `lr` at update warmup_steps to
    `lr * min_lr_ratio` at update total_steps and after.
    """
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.lr_schedule == "constant":
        return c.lr
    progress = min(1.0, (step - c.warmup_steps) / (c.total_steps - c.warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if c.lr_schedule == "cosine" else 1.0 - progress
    return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * decay)


def tensor_grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [P]: the L2 norm of each gradient tensor, in order."""
    if not grads:
        return torch.zeros(0)
    return torch.stack([g.detach().float().norm(2).cpu() for g in grads])


def grad_norm(grads: list[torch.Tensor], per_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Total L2 norm (fp32 scalar) as the norm of per-tensor norms in a fixed order, like
    `torch.nn.utils.clip_grad_norm_` without foreach: deterministic, no cross-thread reduction order.
    `per_tensor`: the `tensor_grad_norms` of `grads` when already computed."""
    if not grads:
        return torch.zeros(())
    return (tensor_grad_norms(grads) if per_tensor is None else per_tensor).norm(2)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale grads in place so their total norm is at most `max_norm` (torch's formula)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))


def adamw_update(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], *, lr: float,
                 grad_clip: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One optimizer update of `params` from their accumulated grads: a parameter without a grad
    (e.g. an expert no token reached) gets zeros, so every parameter is stepped and has optimizer
    state, as in Megatron's contiguous grad buffer; total norm (before clipping), clip to
    `grad_clip` (0: off), AdamW step at `lr`; a non-finite norm skips the step (as Megatron does:
    weights and moments stay intact). Zeroes the grads. Returns (total norm, per-tensor norms,
    whether the step was applied)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    per_tensor = tensor_grad_norms(grads)
    norm = grad_norm(grads, per_tensor)
    applied = bool(torch.isfinite(norm))
    if applied:
        if grad_clip > 0:
            clip_grads_(grads, grad_clip, norm)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, per_tensor, applied


def restore_adamw_state(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                        saved: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace ``optimizer``'s AdamW moments by a checkpoint's (``saved``: per parameter name its
    ``step``, ``exp_avg``, ``exp_avg_sq``), on each parameter's device and dtype; grads cleared."""
    optimizer.state.clear()
    for name, s in saved.items():
        p = params[name]
        optimizer.state[p] = {"step": s["step"].detach().clone().cpu(),
                              "exp_avg": s["exp_avg"].detach().to(p.device, p.dtype).clone(),
                              "exp_avg_sq": s["exp_avg_sq"].detach().to(p.device, p.dtype).clone()}
    optimizer.zero_grad(set_to_none=True)
