"""`tis`: truncated importance sampling — weight each loss token by the train/rollout likelihood
ratio, truncated at `cap`:

    w = min(exp(ℓ), cap),   ℓ = log π_train − log π_rollout at the level:
        token: the token's own;  sequence: the sum over the sample;  geometric: the mean over the sample

Sources: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
(token TIS); verl rollout importance sampling (sequence / geometric levels).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from axrl.algo.corrections.levels import Level
from axrl.algo.corrections.registry import correction
from axrl.algo.terms import CorrectionInputs, CorrectionTerms, LossRule, flag


class TisParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    level: Level = "token"
    cap: float = Field(2.0, gt=0)


@correction("tis", params=TisParams, rules=LossRule.TIS_TRUNCATED | LossRule.NO_ROLLOUT,
            summary="train/rollout ratio as weight, truncated at cap (token, sequence or geometric)",
            source="Yao et al. 2025 (off-policy TIS); verl rollout IS levels")
def tis(x: CorrectionInputs, p: TisParams) -> CorrectionTerms:
    ok = x.available
    raw = torch.exp(x.log_ratio(p.level))  # may be inf for a huge ratio: the cap maps it to `cap`
    capped = (raw > p.cap) & ok
    weight = torch.where(ok, raw.clamp(max=p.cap), torch.ones_like(raw))
    return CorrectionTerms(weight, flag(capped, LossRule.TIS_TRUNCATED) | flag(x.mask & ~ok, LossRule.NO_ROLLOUT))
