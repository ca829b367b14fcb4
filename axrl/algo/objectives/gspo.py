"""`gspo` and `gspo_token`: group sequence policy optimisation — the PPO clip applied to the
sequence ratio s = exp(mean_t log r_t) of the token's sample (the mean over its loss tokens).

    gspo:        ℓ_t = max(−Â_t·s, −Â_t·clip(s, 1 − ε_low, 1 + ε_high))           (gradient through s)
    gspo_token:  the same with s_t = exp(sg(log s) + lp_t − sg(lp_t)), numerically s, whose
                 gradient is s·∇lp_t: each token keeps its own advantage.

Every token of a sample carries its sample's loss value, so any `loss_agg` weighs the sample's
loss by its tokens (`seq-mean-token-mean` gives the paper's per-sequence mean). With one advantage
per sequence both forms give the same gradient. The paper's band is narrow (ε_low 3e-4,
ε_high 4e-4): set `algo.clip_low` / `algo.clip_high`.

Source: Zheng et al. 2025 (Qwen), "Group Sequence Policy Optimization".
"""

from __future__ import annotations

import torch

from axrl.algo.objectives.registry import objective
from axrl.algo.registry import NoParams
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs, flag, per_sample

_RULES = LossRule.CLIP_HIGH | LossRule.CLIP_LOW | LossRule.RATIO_CLAMP
_SOURCE = "Zheng et al. 2025 (Qwen), Group Sequence Policy Optimization"


def _clipped(x: TokenInputs, band: ClipBand, s: torch.Tensor) -> ObjectiveTerms:
    """The PPO clip on a (per-token broadcast) sequence ratio."""
    adv, mask = x.adv, x.mask
    pg_1 = -adv * s
    pg_2 = -adv * s.clamp(1.0 - band.low, 1.0 + band.high)
    clipped = (pg_2 > pg_1) & mask
    loss = torch.where(mask, torch.where(clipped, pg_2, pg_1), torch.zeros_like(pg_1))
    rules = (flag(clipped & (adv > 0), LossRule.CLIP_HIGH) | flag(clipped & (adv < 0), LossRule.CLIP_LOW)
             | flag(x.clamped(), LossRule.RATIO_CLAMP))
    return ObjectiveTerms(loss=loss, ratio=s.detach(), rules=rules)


def sequence_log_ratio(x: TokenInputs) -> torch.Tensor:
    """log s of each token's sample: the mean of its clamped token log ratios (carries grad)."""
    return per_sample(x.log_ratio(), x.mask, x.offsets, "mean")


@objective("gspo", rules=_RULES, summary="PPO clip on the sequence ratio exp(mean log r)", source=_SOURCE)
def gspo(x: TokenInputs, band: ClipBand, params: NoParams) -> ObjectiveTerms:
    return _clipped(x, band, torch.exp(sequence_log_ratio(x)))


@objective("gspo_token", rules=_RULES,
           summary="GSPO-token: the sequence ratio's value, each token's own gradient and advantage", source=_SOURCE)
def gspo_token(x: TokenInputs, band: ClipBand, params: NoParams) -> ObjectiveTerms:
    log_s = sequence_log_ratio(x).detach() + x.lp - x.lp.detach()
    return _clipped(x, band, torch.exp(log_s))
