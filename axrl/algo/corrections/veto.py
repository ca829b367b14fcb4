"""`veto`: drop a whole sample from the loss when any of its tokens has a train/rollout ratio
below `threshold` (one catastrophic token — a token the trainer finds far less likely than the
engine did — discredits the sequence):

    w_t = 0 for every token of sample i if min_{t∈i} exp(log π_train − log π_rollout) < threshold, else 1

Source: verl rollout importance sampling, `rollout_is_veto_threshold`; AxisRL
`mismatch_token_veto_threshold`.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

from axrl.algo.corrections.registry import correction
from axrl.algo.terms import CorrectionInputs, CorrectionTerms, LossRule, flag, per_sample


class VetoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    threshold: float = Field(1e-4, gt=0)


@correction("veto", params=VetoParams, rules=LossRule.VETO,
            summary="drop a sequence with any token ratio below threshold",
            source="verl rollout_is_veto_threshold; AxisRL mismatch_token_veto_threshold")
def veto(x: CorrectionInputs, p: VetoParams) -> CorrectionTerms:
    bad = x.available & (x.token_log_ratio() < math.log(p.threshold))
    vetoed = (per_sample(bad.to(x.old.dtype), x.mask, x.offsets, "sum") > 0) & x.mask
    weight = torch.where(vetoed, torch.zeros_like(x.old), torch.ones_like(x.old))
    return CorrectionTerms(weight, flag(vetoed, LossRule.VETO))
