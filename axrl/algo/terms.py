"""The vocabulary shared by policy objectives (`axrl.algo.objectives`) and off-policy corrections
(`axrl.algo.corrections`): their per-token inputs and outputs, and the rule codes recorded per
token as `/tokens/loss_rule` (docs/trace-format.md, docs/algorithms.md).

Everything is per token of one micro-batch ([T_mb]); samples are never split across
micro-batches, so per-sample quantities (sequence ratios, vetoes) are computed inside one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag

import torch

from axrl.algo.aggregation import segment_sum

__all__ = ["LossRule", "RULE_NAMES", "TokenInputs", "ObjectiveTerms", "CorrectionInputs", "CorrectionTerms",
           "ClipBand", "per_sample", "no_rules", "flag"]


class LossRule(IntFlag):
    """What acted on a loss token, as bits of `/tokens/loss_rule` (uint16; 0 = trained plainly).

    A token can carry several bits (e.g. clipped by the objective *and* truncated by TIS)."""

    CLIP_HIGH = 1        # ratio above the band's top with A ≥ 0: no gradient (PPO, GSPO, grpo2)
    CLIP_LOW = 2         # ratio below the band's floor with A < 0: no gradient (PPO, GSPO, grpo2)
    DUAL_CLIP = 4        # dual-clip PPO bound −c·A taken (A < 0): no gradient
    SOFT_CLIP = 8        # weight capped but gradient kept (grpo2 A < 0 above dual_soft_clip, CISPO, TOPR)
    RATIO_CLAMP = 16     # |log π_θ − log π_old| (or an untruncated behaviour weight's log) beyond log_ratio_clamp
    TIS_TRUNCATED = 32   # train/rollout weight truncated at the TIS cap (or algo.behaviour_weight_cap)
    MIS_MASKED = 64      # train/rollout weight outside [lower, upper]: masked (MIS)
    VETO = 128           # sequence dropped: one of its tokens had a train/rollout ratio below the veto threshold
    ICEPOP_MASKED = 256  # train/rollout ratio outside [α, β]: masked (IcePop)
    NO_ROLLOUT = 512     # loss token without a finite rollout logprob (corrections leave it at weight 1)


#: rule → the name used in metrics (`rule_<name>_frac`) and in `axrl-debug` output
RULE_NAMES: dict[LossRule, str] = {r: r.name.lower() for r in LossRule}


def flag(condition: torch.Tensor, rule: LossRule) -> torch.Tensor:
    """int32 [T]: `rule` where `condition` (bool [T]) holds, else 0."""
    return condition.to(torch.int32) * int(rule)


def no_rules(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=torch.int32, device=mask.device)


def per_sample(values: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, how: str) -> torch.Tensor:
    """[T] → [T]: each sample's "sum" or "mean" of `values` over its `mask` tokens, broadcast back
    to every token of the sample (differentiable; 0 for a sample without mask tokens)."""
    m = mask.to(values.dtype)
    total = segment_sum(torch.where(mask, values, torch.zeros_like(values)), offsets)
    if how == "mean":
        total = total / segment_sum(m, offsets).clamp_min(1.0)
    elif how != "sum":
        raise ValueError(f"per_sample: how must be 'sum' or 'mean', got {how!r}")
    lengths = (offsets[1:] - offsets[:-1]).to(device=values.device)
    return torch.repeat_interleave(total, lengths)


@dataclass(frozen=True)
class ClipBand:
    """The shared ratio band of the clipped objectives: [1 − low, 1 + high], dual-clip c (PPO)."""

    low: float
    high: float
    dual: float | None = None


@dataclass
class TokenInputs:
    """What an objective sees, all [T_mb] and finite at every position (masked positions hold
    stand-ins: lp = 0, old = lp, adv = 0): lp = log π_θ (carries grad), old = log π_old (the
    trainer's recompute before the update, detached), adv = Â, mask = loss tokens."""

    lp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    offsets: torch.Tensor
    log_ratio_clamp: float | None = 20.0

    def log_ratio(self) -> torch.Tensor:
        """log r = lp − old, clamped to ±log_ratio_clamp so exp() cannot overflow (carries grad)."""
        lr = self.lp - self.old
        if self.log_ratio_clamp is not None:
            lr = lr.clamp(-self.log_ratio_clamp, self.log_ratio_clamp)
        return lr

    def clamped(self) -> torch.Tensor:
        """bool [T]: loss tokens whose log ratio lies beyond the clamp."""
        if self.log_ratio_clamp is None:
            return torch.zeros_like(self.mask)
        return ((self.lp - self.old).detach().abs() > self.log_ratio_clamp) & self.mask


@dataclass
class ObjectiveTerms:
    """An objective's per-token output, all [T_mb]."""

    loss: torch.Tensor    # surrogate loss ℓ_t (carries grad); exactly 0 at masked positions
    ratio: torch.Tensor   # the ratio the objective used (token r_t, or the sequence ratio s), detached
    rules: torch.Tensor   # int32 LossRule bits (0 at masked positions)


@dataclass
class CorrectionInputs:
    """What a rollout↔trainer correction sees, all [T_mb]: old = log π_old (detached), rollout =
    log π_rollout (NaN where the engine gave none), mask = loss tokens; log_ratio_clamp: the loss's
    `log_ratio_clamp`, the overflow guard of an untruncated weight (`tis` with `cap: null`)."""

    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    offsets: torch.Tensor
    log_ratio_clamp: float | None = None

    @property
    def available(self) -> torch.Tensor:
        """bool [T]: loss tokens with a finite rollout logprob."""
        return torch.isfinite(self.rollout) & self.mask

    def token_log_ratio(self) -> torch.Tensor:
        """log(π_train/π_rollout) = old − rollout where available, else 0 (detached)."""
        ok = self.available
        return torch.where(ok, self.old.detach() - torch.where(ok, self.rollout, 0.0), torch.zeros_like(self.old))

    def log_ratio(self, level: str) -> torch.Tensor:
        """The train/rollout log ratio at `level`, per token: "token" (its own), "sequence" (the
        sample's sum: log of the sequence likelihood ratio) or "geometric" (the sample's mean)."""
        lr = self.token_log_ratio()
        if level == "token":
            return lr
        if level in ("sequence", "geometric"):
            return per_sample(lr, self.available, self.offsets, "sum" if level == "sequence" else "mean")
        raise ValueError(f"unknown correction level {level!r}; expected token, sequence or geometric")


@dataclass
class CorrectionTerms:
    """A correction's per-token output, all [T_mb]: a detached weight multiplying the token's
    policy loss (1 = untouched, 0 = masked) and the LossRule bits it set."""

    weight: torch.Tensor
    rules: torch.Tensor
