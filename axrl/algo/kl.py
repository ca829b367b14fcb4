"""Per-token KL estimators (Schulman, "Approximating KL Divergence", 2020).

Direction: all three estimate KL(π ‖ π_ref) = E_{x∼π}[log π(x) − log π_ref(x)], the "reverse"
KL used as a penalty in RLHF/GRPO, from tokens x sampled from the policy π. With

    r = log π_ref(x) − log π(x)    (= ref − lp, the log of the ratio π_ref/π)

    k1 = −r                     = lp − ref      unbiased, high variance, can be negative
    k2 = r² / 2                                 biased (low bias near π≈π_ref), always ≥ 0
    k3 = exp(r) − 1 − r                         unbiased (E_π[exp(r)] = 1), always ≥ 0 because
                                                exp(r) ≥ 1 + r; the "low_var_kl" of verl/GRPO

Gradient note: used as a *loss* (added per token and back-propagated through lp), the three
estimators have different expected gradients under on-policy sampling x ∼ π:
    ∇k1 = ∇lp                    → E_π[∇ log π] = 0: k1 as a loss pushes nothing on average
    ∇k2 = (lp − ref)·∇lp         → ∇ KL(π ‖ π_ref), the true reverse-KL gradient
    ∇k3 = (1 − π_ref/π)·∇lp      → −E_{π_ref}[∇ log π] = ∇ KL(π_ref ‖ π), the *forward* KL's
So the values estimate KL(π‖π_ref) but the gradients do not all follow it. k3 is the GRPO /
verl "low_var_kl" default anyway; k2 is the choice for a gradient-faithful reverse KL.
"""

from __future__ import annotations

import torch

from axrl.algo.modes import KLEstimator

__all__ = ["KLEstimator", "kl_penalty", "kl_k1", "kl_k2", "kl_k3"]


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = lp − ref (= −r)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (ref − lp)² / 2."""
    r = ref_logprobs - logprobs
    return 0.5 * r * r


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(r) − 1 − r with r = ref − lp.

    Near r ≈ 0 the value is ≈ r²/2 while both terms are ≈ r, so in float32 the subtraction
    cancels most digits (relative error ~1e-7/|r|). Computing in float64 (expm1, then cast
    back) keeps the result accurate; float32 inputs are exact in float64, and the cost is nil
    for a [T] vector.
    """
    dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    r = ref_logprobs.to(torch.float64) - logprobs.to(torch.float64)
    return (torch.expm1(r) - r).to(dtype)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               estimator: KLEstimator = "k3", *, log_ratio_clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) (see module docstring), elementwise, same shape.

    Args:
        logprobs: log π(x) of the sampled tokens (may carry grad).
        ref_logprobs: log π_ref(x) of the same tokens.
        estimator: "k1" | "k2" | "k3".
        log_ratio_clamp: if set, r = ref − lp is clamped to [−c, c] before the estimator, so k3's
            exp(r) cannot overflow when the reference assigns a token far more mass than the
            policy. It zeroes the gradient of clamped tokens; None (default) is the exact formula.

    Masking is the caller's job: select with `torch.where` (not multiplication) *before* calling
    if some positions hold NaN/inf, or their gradients become NaN.
    """
    if log_ratio_clamp is not None:
        r = (ref_logprobs - logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
        # rebuild from the clamped ratio so all estimators see the same r
        logprobs = ref_logprobs - r
    if estimator == "k1":
        return kl_k1(logprobs, ref_logprobs)
    if estimator == "k2":
        return kl_k2(logprobs, ref_logprobs)
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")
