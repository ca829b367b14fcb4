"""`ppo`: the clipped surrogate with an asymmetric band ("clip-higher", DAPO) and optional dual clip.

    r = exp(lp − old),  ℓ = max(−Â·r, −Â·clip(r, 1 − ε_low, 1 + ε_high));  dual (Â < 0): ℓ = min(ℓ, −c·Â)

Sources: Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO, clip-higher); Ye et al. 2020 (dual clip).
"""

from __future__ import annotations

import torch

from axrl.algo.objectives.registry import objective
from axrl.algo.registry import NoParams
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs, flag


@objective("ppo", rules=LossRule.CLIP_HIGH | LossRule.CLIP_LOW | LossRule.DUAL_CLIP | LossRule.RATIO_CLAMP,
           summary="clipped surrogate, asymmetric band, optional dual clip",
           source="Schulman et al. 2017; DAPO (Yu et al. 2025) clip-higher; Ye et al. 2020 dual clip")
def ppo(x: TokenInputs, band: ClipBand, params: NoParams) -> ObjectiveTerms:
    adv, mask = x.adv, x.mask
    ratio = torch.exp(x.log_ratio())
    pg_1 = -adv * ratio
    pg_2 = -adv * ratio.clamp(1.0 - band.low, 1.0 + band.high)
    # torch.where instead of torch.maximum: at a tie maximum splits the gradient in halves;
    # here ties keep the unclipped branch, so "clipped" ⇔ zero surrogate gradient, exactly.
    clipped = (pg_2 > pg_1) & mask
    pg = torch.where(clipped, pg_2, pg_1)
    rules = flag(clipped & (adv > 0), LossRule.CLIP_HIGH) | flag(clipped & (adv < 0), LossRule.CLIP_LOW)
    if band.dual is not None:
        pg_3 = -adv * band.dual
        dual = (adv < 0) & (pg > pg_3) & mask
        pg = torch.where(dual, pg_3, pg)
        rules = rules | flag(dual, LossRule.DUAL_CLIP)
    pg = torch.where(mask, pg, torch.zeros_like(pg))
    return ObjectiveTerms(loss=pg, ratio=ratio.detach(), rules=rules | flag(x.clamped(), LossRule.RATIO_CLAMP))
