"""`cispo`: clipped importance-sampling-weight policy optimisation — the weight is clipped, the
gradient of every token is kept.

    ℓ = −sg(clip(r, 1 − ε_low, 1 + ε_high)) · Â · lp

Source: MiniMax-M1 technical report (MiniMax 2025), CISPO. The paper keeps no lower bound
(a large ε_low, e.g. `algo.clip_low=1.0`) and tunes ε_high.
"""

from __future__ import annotations

import torch

from axrl.algo.objectives.registry import objective
from axrl.algo.registry import NoParams
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs, flag


@objective("cispo", rules=LossRule.SOFT_CLIP | LossRule.RATIO_CLAMP,
           summary="REINFORCE with the detached ratio clipped to the band; gradient through every token",
           source="MiniMax-M1 (MiniMax 2025), CISPO")
def cispo(x: TokenInputs, band: ClipBand, params: NoParams) -> ObjectiveTerms:
    r = torch.exp(x.log_ratio()).detach()
    lo, hi = 1.0 - band.low, 1.0 + band.high
    w = r.clamp(lo, hi)
    loss = torch.where(x.mask, -x.adv * w * x.lp, torch.zeros_like(x.lp))
    soft = x.mask & ((r > hi) | (r < lo))
    return ObjectiveTerms(loss=loss, ratio=r,
                          rules=flag(soft, LossRule.SOFT_CLIP) | flag(x.clamped(), LossRule.RATIO_CLAMP))
