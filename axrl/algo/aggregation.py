"""Loss aggregation: per-token losses of one micro-batch → its share of the batch loss.

Every mode divides by *batch-wide* counts from `LossContext`, never by counts of the micro-batch,
so the sum over micro-batches of the returned values (and of their gradients) equals the value
on the whole batch, whatever the split (samples are never split across micro-batches).

With ℓ_t the per-token loss, m_t ∈ {0,1} the loss mask, n_i = Σ_{t∈i} m_t, and batch counts
M = ctx.num_loss_tokens, S = ctx.num_loss_samples (samples with n_i > 0):

    "token-mean"               Σ_t m_t ℓ_t / M                 every token weighs the same (DAPO)
    "seq-mean-token-mean"      Σ_i (Σ_{t∈i} m_t ℓ_t / n_i) / S  every sample weighs the same
                                                                (original GRPO)
    "seq-mean-token-sum"       Σ_t m_t ℓ_t / S                 every token weighs the same, and
                                                                the loss scales with length
    "seq-mean-token-sum-norm"  Σ_t m_t ℓ_t / (S · L)           Dr. GRPO: a constant L (e.g. max
                                                                generation length) in place of n_i

Samples without loss tokens contribute 0 and are not counted in S. An empty batch (M = 0 or
S = 0) gives 0 rather than NaN.
"""

from __future__ import annotations

import torch

from axrl.algo.modes import LOSS_AGG_MODES, LossAgg
from axrl.train.protocol import LossContext


__all__ = ["LossAgg", "LOSS_AGG_MODES", "aggregate_loss", "aggregation_weights", "segment_sum"]


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[T] → [N]: the sum of each sample's tokens, in the dtype of `values`.

    A difference of prefix sums rather than `index_add`: differentiable and deterministic on GPU
    too (no atomic scatter). The prefix sum runs in float64 because in float32 its rounding error
    grows with the *micro-batch* length (≈1e-7 · Σ|ℓ|, i.e. 1e-2 after 1e5 tokens of O(1)
    losses), which would swamp one short sample's sum.
    """
    v64 = values.to(torch.float64)
    csum = torch.cat([v64.new_zeros(1), v64.cumsum(0)])
    offsets = offsets.to(device=values.device, dtype=torch.int64)
    return (csum[offsets[1:]] - csum[offsets[:-1]]).to(values.dtype)


def aggregate_loss(token_loss: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor,
                   ctx: LossContext, mode: LossAgg = "token-mean",
                   norm_len: float | None = None) -> torch.Tensor:
    """Aggregate per-token losses [T_mb] of a micro-batch with batch-wide normalisation.

    `token_loss` must already be 0 (selected with torch.where) at positions with loss_mask = 0;
    the mask is applied again here only to count tokens.
    """
    mask = loss_mask > 0
    masked = torch.where(mask, token_loss, torch.zeros_like(token_loss))
    if mode == "token-mean":
        return masked.sum() / max(int(ctx.num_loss_tokens), 1)
    denom_samples = max(int(ctx.num_loss_samples), 1)
    if mode == "seq-mean-token-mean":
        per_sample = segment_sum(masked, offsets)
        n_i = segment_sum(mask.to(masked.dtype), offsets)
        return (per_sample / n_i.clamp_min(1.0)).sum() / denom_samples
    if mode == "seq-mean-token-sum":
        return masked.sum() / denom_samples
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs a positive norm_len")
        return masked.sum() / (denom_samples * float(norm_len))
    raise ValueError(f"unknown loss_agg {mode!r}; expected one of {LOSS_AGG_MODES}")


def aggregation_weights(loss_mask: torch.Tensor, offsets: torch.Tensor, ctx: LossContext,
                        mode: LossAgg = "token-mean", norm_len: float | None = None) -> torch.Tensor:
    """[T_mb]: each token's weight g_t in `aggregate_loss` (which is linear in the per-token
    losses: aggregate = Σ_t g_t·ℓ_t), so g_t·ℓ_t is the token's share of the loss. Taken from the
    aggregation itself (its gradient), not re-derived."""
    with torch.enable_grad():
        probe = torch.zeros(loss_mask.shape, dtype=torch.float64, device=loss_mask.device, requires_grad=True)
        total = aggregate_loss(probe, loss_mask, offsets, ctx, mode, norm_len)
        if not total.requires_grad:
            return torch.zeros_like(probe).detach()
        (weight,) = torch.autograd.grad(total, probe)
    return weight
