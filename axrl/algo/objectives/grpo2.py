"""`grpo2`: a REINFORCE-form loss with a detached weight per case of (sign of Â, side of r = 1).

    ℓ = −Â · sg(w) · lp
    Â ≥ 0, r > 1:  w = min(r, 1 + ε_high); no gradient where r > 1 + ε_high (hard clip)
    Â ≥ 0, r ≤ 1:  w = r
    Â < 0, r > 1:  w = min(r, dual_soft_clip); gradient kept above the cap (soft clip, CISPO-like)
    Â < 0, r ≤ 1:  w = max(r, 1 − ε_low); no gradient where r < 1 − ε_low (hard clip)

Source: AxisRL `grpo_trainer.py::grpo2_loss` (its default loss).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from axrl.algo.objectives.registry import objective
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs, flag


class Grpo2Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dual_soft_clip: float = Field(3.0, gt=1.0, description="weight cap of Â < 0 tokens with r > 1")


@objective("grpo2", params=Grpo2Params,
           rules=LossRule.CLIP_HIGH | LossRule.CLIP_LOW | LossRule.SOFT_CLIP | LossRule.RATIO_CLAMP,
           summary="REINFORCE with per-case detached weights: hard clip towards the band, soft clip for Â<0, r>1",
           source="AxisRL grpo_trainer.py::grpo2_loss")
def grpo2(x: TokenInputs, band: ClipBand, params: Grpo2Params) -> ObjectiveTerms:
    adv, mask, lp = x.adv, x.mask, x.lp
    r = torch.exp(x.log_ratio()).detach()
    pos, up = adv >= 0, r > 1.0
    top, floor, cap = 1.0 + band.high, 1.0 - band.low, params.dual_soft_clip
    w = torch.where(pos, torch.where(up, r.clamp(max=top), r), torch.where(up, r.clamp(max=cap), r.clamp(min=floor)))
    clip_high = mask & pos & up & (r > top)
    clip_low = mask & ~pos & ~up & (r < floor)
    soft = mask & ~pos & up & (r > cap)
    lp_grad = torch.where(clip_high | clip_low, lp.detach(), lp)
    loss = torch.where(mask, -adv * w * lp_grad, torch.zeros_like(lp))
    rules = (flag(clip_high, LossRule.CLIP_HIGH) | flag(clip_low, LossRule.CLIP_LOW)
             | flag(soft, LossRule.SOFT_CLIP) | flag(x.clamped(), LossRule.RATIO_CLAMP))
    return ObjectiveTerms(loss=loss, ratio=r, rules=rules)
