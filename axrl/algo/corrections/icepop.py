"""`icepop`: keep the loss tokens whose train/rollout probability ratio lies in [low, high] and
zero the rest (weight 1 inside, 0 outside; combine with `tis` for a weight too):

    w_t = 1 if low ≤ π_train(y_t)/π_rollout(y_t) ≤ high else 0

Source: Ling team (inclusionAI) 2025, IcePop ("Small leak can sink a great ship"), MoE
training–inference mismatch; AxisRL `icepop_masking_low/high`.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from axrl.algo.corrections.levels import check_band
from axrl.algo.corrections.registry import correction
from axrl.algo.terms import CorrectionInputs, CorrectionTerms, LossRule, flag


class IcePopParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    low: float = Field(0.5, ge=0)
    high: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _band(self) -> "IcePopParams":
        check_band(self.low, self.high, ("low", "high"))
        return self


@correction("icepop", params=IcePopParams, rules=LossRule.ICEPOP_MASKED,
            summary="mask tokens whose train/rollout ratio is outside [low, high]",
            source="IcePop (inclusionAI Ling team 2025); AxisRL icepop_masking_low/high")
def icepop(x: CorrectionInputs, p: IcePopParams) -> CorrectionTerms:
    ratio = torch.exp(x.token_log_ratio())
    outside = x.available & ((ratio < p.low) | (ratio > p.high))
    return CorrectionTerms(torch.where(outside, torch.zeros_like(ratio), torch.ones_like(ratio)),
                           flag(outside, LossRule.ICEPOP_MASKED))
