"""`mis`: masked importance sampling — the train/rollout ratio as weight where it lies inside
[lower, upper], 0 (the token leaves the loss) outside:

    w = exp(ℓ) if lower ≤ exp(ℓ) ≤ upper else 0     (ℓ at the token / sequence / geometric level, as `tis`)

Source: verl rollout importance sampling, mode "mask" (Yao et al. 2025 follow-up on MIS).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from axrl.algo.corrections.levels import Level, check_band
from axrl.algo.corrections.registry import correction
from axrl.algo.terms import CorrectionInputs, CorrectionTerms, LossRule, flag


class MisParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    level: Level = "token"
    lower: float = Field(0.5, ge=0)
    upper: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _band(self) -> "MisParams":
        check_band(self.lower, self.upper, ("lower", "upper"))
        return self


@correction("mis", params=MisParams, rules=LossRule.MIS_MASKED | LossRule.NO_ROLLOUT,
            summary="train/rollout ratio as weight inside [lower, upper], token masked outside",
            source="verl rollout importance sampling, mode 'mask'")
def mis(x: CorrectionInputs, p: MisParams) -> CorrectionTerms:
    ok = x.available
    raw = torch.exp(x.log_ratio(p.level))
    inside = (raw >= p.lower) & (raw <= p.upper)
    weight = torch.where(ok, torch.where(inside, raw, torch.zeros_like(raw)), torch.ones_like(raw))
    return CorrectionTerms(weight, flag(ok & ~inside, LossRule.MIS_MASKED) | flag(x.mask & ~ok, LossRule.NO_ROLLOUT))
