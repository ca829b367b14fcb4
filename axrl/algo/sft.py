"""Supervised (negative log-likelihood) loss over the loss-masked tokens, for warm-up and SFT."""

from __future__ import annotations

import torch

from axrl.train.protocol import LossContext, PackedBatch


def nll_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
             ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL over the whole batch (normalised by `ctx`, so micro-batches add up)."""
    mask = mb.loss_mask > 0
    nll = -torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum()
    loss = nll / max(ctx.num_loss_tokens, 1)
    return loss, {"loss": float(loss.detach()), "num_loss_tokens": float(mask.sum())}
