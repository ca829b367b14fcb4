"""The critic's loss and its metric: PPO's clipped value loss and the explained variance of the
values, shared by the torch and Megatron critics. The returns it regresses on come from GAE
(`axrl.algo.gae`), which sits above this layer and passes them in.

Value loss (PPO's clipped value loss; c = `critic.value_clip`, V_old the values GAE used):

    V_clip = V_old + clip(V − V_old, −c, c)
    L_V    = ½ · Σ_t m_t · max((V_t − R_t)², (V_clip,t − R_t)²) / Σ_t m_t     (token mean)

without clipping (c = null) L_V = ½ · token-mean (V − R)². `value_clip_frac` is the fraction of
trained tokens where the clipped term is the larger (the clip changed the loss). Explained
variance of the old values: 1 − Var(R − V_old) / Var(R) over the trained tokens.
"""

from __future__ import annotations

import torch

__all__ = ["explained_variance", "value_loss"]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None, denom: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_V summed over `mask`'s tokens / `denom`, clipped-token count) — the module docstring's
    clipped value loss; `denom` is the trained-token count of the whole optimizer update, so
    micro-batch losses add up to the update's token mean."""
    m = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * (err * m).sum() / denom, values.new_zeros(())
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err_clipped = (clipped - returns) ** 2
    # counted only where the clip acted: within ±c, V_old + (V − V_old) equals V up to rounding,
    # and which of the two equal terms is "larger" would be decided by the last bit
    acted = (err_clipped > err) & ((values - old_values).abs() > clip)
    return 0.5 * (torch.maximum(err, err_clipped) * m).sum() / denom, (acted.to(m.dtype) * m).sum()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over `mask`'s tokens (NaN when Var(R) is 0 or no token)."""
    m = torch.as_tensor(mask).reshape(-1) > 0
    if not bool(m.any()):
        return float("nan")
    r, v = returns.double()[m], values.double()[m]
    var = float(r.var(unbiased=False))
    return float("nan") if var == 0 else 1.0 - float((r - v).var(unbiased=False)) / var
