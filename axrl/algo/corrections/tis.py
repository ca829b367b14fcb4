"""`tis`: truncated importance sampling — weight each loss token by the train/rollout likelihood
ratio, truncated at `cap` (`cap: null`: not truncated, the plain importance weight):

    w = min(exp(ℓ), cap),   ℓ = log π_train − log π_rollout at the level:
        token: the token's own;  sequence: the sum over the sample;  geometric: the mean over the sample

With `cap: null` at token level this is the behaviour weight π_prox/μ of decoupled PPO (AReaL), the
weight asynchronous runs train with (`algo.decoupled`, `algo.behaviour_weight_cap`). Untruncated,
ℓ is clamped at the loss's `log_ratio_clamp` (20: w ≤ 4.9e8, rule `ratio_clamp`) — the guard the
PPO ratio has — so one broken engine logprob cannot overflow the weight to inf and make the whole
update non-finite; it never binds in a sane run.

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
    cap: float | None = Field(2.0, gt=0, description="truncation (null: none, the plain importance weight)")


@correction("tis", params=TisParams, rules=LossRule.TIS_TRUNCATED | LossRule.NO_ROLLOUT | LossRule.RATIO_CLAMP,
            summary="train/rollout ratio as weight, truncated at cap (token, sequence or geometric)",
            source="Yao et al. 2025 (off-policy TIS); verl rollout IS levels")
def tis(x: CorrectionInputs, p: TisParams) -> CorrectionTerms:
    ok = x.available
    if p.cap is None:
        lr = x.log_ratio(p.level)
        clamped = torch.zeros_like(ok)
        if x.log_ratio_clamp is not None:
            clamped = (lr > x.log_ratio_clamp) & ok
            lr = lr.clamp(max=x.log_ratio_clamp)
        weight = torch.where(ok, torch.exp(lr), torch.ones_like(lr))
        return CorrectionTerms(weight, flag(clamped, LossRule.RATIO_CLAMP) | flag(x.mask & ~ok, LossRule.NO_ROLLOUT))
    raw = torch.exp(x.log_ratio(p.level))  # may be inf for a huge ratio: the cap maps it to `cap`
    capped = (raw > p.cap) & ok
    weight = torch.where(ok, raw.clamp(max=p.cap), torch.ones_like(raw))
    return CorrectionTerms(weight, flag(capped, LossRule.TIS_TRUNCATED) | flag(x.mask & ~ok, LossRule.NO_ROLLOUT))
