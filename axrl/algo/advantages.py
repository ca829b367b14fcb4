"""Outcome-reward advantage estimators (critic-free) and their broadcast to tokens.

Every estimator here maps one scalar reward per sample to one scalar advantage per sample; the
same value is then given to each of the sample's loss tokens (`token_advantages`).

GRPO (group-normalised), for sample i in group g with G_g members:

    A_i = (r_i − mean_g) / (std_g + eps)        normalize_std=True   (GRPO, DeepSeekMath)
    A_i =  r_i − mean_g                         normalize_std=False  (Dr. GRPO: no std division,
                                                                      which otherwise up-weights
                                                                      near-deterministic groups)

    std_g = sqrt( Σ_j (r_j − mean_g)² / (G_g − ddof) ),  ddof = 1 if unbiased else 0

Population std (`unbiased=False`, ddof=0) is the default here: it is the maximum-likelihood
scale and is defined for any group size. Beware when comparing with other stacks: verl and TRL
call `torch.std` with its default, i.e. the *sample* std (ddof=1); pass `unbiased=True` to match
them. The two differ by the factor sqrt((G−1)/G) (≈0.935 for G=8).

A group of size 1 has no baseline to compare with, so its advantage is 0 (it contributes no
policy gradient), whatever the option. A group whose rewards are all equal gets 0 too
(0 / (0 + eps) = 0).

REINFORCE with a batch-mean baseline: A_i = r_i − mean over the whole batch (no grouping).
"""

from __future__ import annotations

from typing import Hashable, Literal, Sequence

import numpy as np
import torch

AdvantageEstimator = Literal["grpo", "dr_grpo", "reinforce"]

__all__ = [
    "AdvantageEstimator",
    "group_normalized_advantages",
    "grpo_advantages",
    "reinforce_advantages",
    "compute_advantages",
    "token_advantages",
]


def _as_float_tensor(rewards: torch.Tensor | np.ndarray | Sequence[float]) -> torch.Tensor:
    t = torch.as_tensor(rewards)
    if t.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(t.shape)}")
    return t if t.is_floating_point() else t.to(torch.float32)


def _group_index(group_ids: torch.Tensor | np.ndarray | Sequence[Hashable], n: int) -> torch.Tensor:
    """Dense int64 [N] group index in 0..G−1 from arbitrary group labels (ints, strings, …)."""
    if isinstance(group_ids, (torch.Tensor, np.ndarray)):
        ids = torch.as_tensor(group_ids)
        if ids.dim() != 1 or ids.numel() != n:
            raise ValueError(f"group_ids must be 1-D with {n} entries, got shape {tuple(ids.shape)}")
        _, inverse = torch.unique(ids, return_inverse=True)
        return inverse.to(torch.int64)
    labels = list(group_ids)
    if len(labels) != n:
        raise ValueError(f"group_ids must have {n} entries, got {len(labels)}")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in labels], dtype=torch.int64)


def group_normalized_advantages(
    rewards: torch.Tensor | np.ndarray | Sequence[float],
    group_ids: torch.Tensor | np.ndarray | Sequence[Hashable],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """GRPO / Dr. GRPO advantages, one per sample: see the module docstring for the formula.

    Args:
        rewards: [N] scalar reward per sample.
        group_ids: [N] group label per sample (samples of the same prompt share a label); any
            hashable labels, need not be contiguous or sorted.
        normalize_std: divide by (std_g + eps) (GRPO); False only subtracts the mean (Dr. GRPO).
        eps: added to the std, so all-equal groups give 0 rather than 0/0.
        unbiased: sample std (ddof=1, as verl/TRL) instead of population std (ddof=0, default).

    Returns:
        float [N] in the dtype of `rewards` (float32 for integer rewards). Computed in float64
        internally so the result does not depend on the order samples appear in.
    """
    r = _as_float_tensor(rewards)
    n = r.numel()
    if n == 0:
        return r.clone()
    gi = _group_index(group_ids, n)
    num_groups = int(gi.max()) + 1
    r64 = r.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gi, torch.ones_like(r64))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gi, r64) / count
    centred = r64 - mean[gi]
    adv = centred
    if normalize_std:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gi, centred * centred)
        ddof = 1.0 if unbiased else 0.0
        # clamp only guards the division for size-1 groups with ddof=1; those are zeroed below.
        var = sq / (count - ddof).clamp_min(1.0)
        adv = centred / (var.sqrt()[gi] + eps)
    # Singletons: no group baseline exists. (r − mean) is already 0 for them, but say so
    # explicitly so the rule does not hinge on floating-point cancellation.
    adv = torch.where(count[gi] > 1, adv, torch.zeros_like(adv))
    return adv.to(r.dtype)


# The algorithm's usual name.
grpo_advantages = group_normalized_advantages


def reinforce_advantages(rewards: torch.Tensor | np.ndarray | Sequence[float]) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline: A_i = r_i − (1/N) Σ_j r_j."""
    r = _as_float_tensor(rewards)
    if r.numel() == 0:
        return r.clone()
    r64 = r.to(torch.float64)
    return (r64 - r64.mean()).to(r.dtype)


def compute_advantages(
    rewards: torch.Tensor | np.ndarray | Sequence[float],
    group_ids: torch.Tensor | np.ndarray | Sequence[Hashable] | None = None,
    *,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """Config-driven entry point: "grpo" (mean/std per group), "dr_grpo" (mean only per group),
    "reinforce" (batch mean; `group_ids` ignored)."""
    if estimator == "reinforce":
        return reinforce_advantages(rewards)
    if estimator not in ("grpo", "dr_grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}; "
                         f"expected 'grpo', 'dr_grpo' or 'reinforce'")
    if group_ids is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_ids")
    return group_normalized_advantages(rewards, group_ids, normalize_std=estimator == "grpo",
                                       eps=eps, unbiased=unbiased)


def token_advantages(sample_advantages: torch.Tensor, offsets: torch.Tensor,
                     loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages [N] to tokens [T] through CSR `offsets` [N+1].

    Token t of sample i gets A_i · loss_mask[t], so prompt / environment tokens carry 0 (and the
    trace's /tokens/advantage column reads naturally). Returns float32 [T].
    """
    adv = torch.as_tensor(sample_advantages)
    offsets = torch.as_tensor(offsets, dtype=torch.int64)
    if adv.dim() != 1 or adv.numel() != offsets.numel() - 1:
        raise ValueError(f"sample_advantages must be [N={offsets.numel() - 1}], "
                         f"got shape {tuple(adv.shape)}")
    lengths = offsets[1:] - offsets[:-1]
    per_token = torch.repeat_interleave(adv.to(torch.float32), lengths)
    if per_token.numel() != loss_mask.numel():
        raise ValueError(f"offsets cover {per_token.numel()} tokens but loss_mask has "
                         f"{loss_mask.numel()}")
    # where, not multiply: a NaN/inf advantage of a sample must not leak into masked tokens.
    return torch.where(loss_mask.reshape(-1) > 0, per_token, torch.zeros_like(per_token))
