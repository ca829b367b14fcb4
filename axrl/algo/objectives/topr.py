"""`topr`: Tapered Off-Policy REINFORCE — plain REINFORCE on tokens with Â ≥ 0, the ratio capped
at 1 on tokens with Â < 0.

    ℓ = −Â · sg(w) · lp,   w = 1 (Â ≥ 0),   w = clamp(ρ, 0, 1) (Â < 0)

with ρ = r_t (level "token") or the sequence ratio exp(Σ_t log r_t) of the token's sample
(level "sequence", the paper's trajectory-level form).

Source: Le Roux et al. 2025, "Tapered Off-Policy REINFORCE" (TOPR); AxisRL `topr_loss` (token level).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from axrl.algo.objectives.registry import objective
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs, flag, per_sample


class ToprParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    level: Literal["token", "sequence"] = "token"


@objective("topr", params=ToprParams, rules=LossRule.SOFT_CLIP | LossRule.RATIO_CLAMP,
           summary="REINFORCE; negative-advantage tokens weighted by min(ratio, 1), token or sequence ratio",
           source="Le Roux et al. 2025, Tapered Off-Policy REINFORCE")
def topr(x: TokenInputs, band: ClipBand, params: ToprParams) -> ObjectiveTerms:
    log_r = x.log_ratio().detach()
    if params.level == "sequence":
        log_r = per_sample(log_r, x.mask, x.offsets, "sum")
    r = torch.exp(log_r)
    neg = x.adv < 0
    w = torch.where(neg, r.clamp(0.0, 1.0), torch.ones_like(r))
    loss = torch.where(x.mask, -x.adv * w * x.lp, torch.zeros_like(x.lp))
    return ObjectiveTerms(loss=loss, ratio=r, rules=flag(x.mask & neg & (r > 1.0), LossRule.SOFT_CLIP)
                          | flag(x.clamped(), LossRule.RATIO_CLAMP))
