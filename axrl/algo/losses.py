"""The policy loss implementing `axrl.train.protocol.LossFn`: an objective from the registry
(`algo.loss`), the rollout↔trainer corrections (`algo.correction`), a KL penalty against the frozen
reference and an entropy bonus, aggregated with `loss_agg`.

Per loss token t (m_t = 1), with lp = log π_θ(x_t) (carries grad), old = log π_old(x_t) (the
trainer's recompute before the update; lp.detach() when absent, i.e. one on-policy update),
roll = log π_rollout(x_t) (inference engine), ref = log π_ref(x_t), A = advantage:

    pg_t     = objective(lp, old, A)_t                 see `axrl.algo.objectives` / docs/algorithms.md
    w_t      = Π_c correction_c(old, roll)_t            detached; 1 without corrections (`axrl.algo.corrections`)
    ℓ_t      = w_t · pg_t + β · KL_k(lp, ref) − α · H_t  KL only when β > 0; H_t carries grad

ℓ_t is then aggregated over loss tokens with `cfg.loss_agg` (see `axrl.algo.aggregation`),
normalised by batch-wide counts in `LossContext`, so summing the returned losses (and their
gradients) over micro-batches gives the full-batch loss (and gradient). `algo.tis` / `tis_cap`
are the short form of the token-level `tis` correction (used when `correction` has no `tis`).

Masking: every per-token input is first replaced, with `torch.where`, by a finite stand-in at
positions where loss_mask = 0 (rollout logprobs are NaN there; logprobs may be −inf or junk at
prompt tokens). Multiplying by the mask instead would give 0 · NaN = NaN in the forward and,
worse, NaN gradients through exp(). So masked positions contribute exactly 0 and get 0 gradient.

Metrics (floats). Unless noted, SUMMING a key over the micro-batches of one batch gives the batch
value, because each is normalised by batch-wide counts:
    loss, pg_loss              the loss (with loss_agg) and its policy-gradient part alone
    kl_loss, entropy_loss      β·KL and −α·H parts aggregated with loss_agg (0 when the coef is 0)
    clipfrac                   fraction of loss tokens hard-clipped (rules CLIP_HIGH | CLIP_LOW, / num_loss_tokens)
    clipfrac_high, clipfrac_low   the CLIP_HIGH and CLIP_LOW parts
    dual_clipfrac              fraction of loss tokens where the dual clip bound was taken
    rule_<name>_frac           fraction of loss tokens carrying each rule the objective and corrections can set
    ratio_mean                 token mean of the objective's ratio (the sequence ratio for gspo)
    approx_kl                  token mean of k3 KL(π_old ‖ π_θ) = mean(ρ − 1 − log ρ), ρ = π_θ/π_old
    entropy                    token mean of H_t
    kl                         token mean of KL_k(lp, ref)  (only if ref_logprobs is given)
    is_weight_mean             token mean of w_t (only with corrections)
    tis_weight_mean, tis_capped_frac, tis_missing_frac
                               token mean of min(exp(old − roll), tis_cap), fraction above the cap,
                               fraction of loss tokens without a finite rollout logprob (weight 1
                               there); reported whenever rollout_logprobs is given, applied only with TIS
    num_loss_tokens            raw count of loss tokens in the micro-batch
NOT summable — reduce with max / min (see `reduce_microbatch_metrics`):
    ratio_max, ratio_min       extreme ratio over the micro-batch's loss tokens (1.0 when it has none)
Per-token columns (`TOKEN_COLUMN_PREFIX`, [T_mb]; the backend concatenates them in batch order):
    tokens/is_weight           w_t (1 at non-loss tokens)        → trace /tokens/is_weight
    tokens/loss_rule           LossRule bits (0 at non-loss tokens) → trace /tokens/loss_rule
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from axrl.algo.aggregation import aggregate_loss
from axrl.algo.corrections import CORRECTIONS
from axrl.algo.corrections.tis import TisParams
from axrl.algo.kl import kl_penalty
from axrl.algo.loss_config import PolicyLossConfig
from axrl.algo.objectives import OBJECTIVES
from axrl.algo.terms import RULE_NAMES, ClipBand, CorrectionInputs, LossRule, TokenInputs
from axrl.train.metrics import TOKEN_COLUMN_PREFIX
from axrl.train.protocol import LossContext, PackedBatch

__all__ = ["PolicyLossConfig", "PolicyLoss", "LossTerms", "make_policy_loss"]


@dataclass
class LossTerms:
    """The per-token pieces of the loss of one micro-batch, all [T_mb], 0 at masked positions
    (is_weight: 1). What the loss aggregates, and what dumps and analyses read."""

    mask: torch.Tensor                 # bool: loss tokens
    lp: torch.Tensor                   # log π_θ, detached
    old: torch.Tensor                  # log π_old the ratio used
    entropy: torch.Tensor              # H_t (carries grad)
    pg: torch.Tensor                   # w_t · objective loss (carries grad)
    ratio: torch.Tensor                # the objective's ratio, detached
    is_weight: torch.Tensor            # w_t, detached
    rules: torch.Tensor                # int32 LossRule bits
    kl: torch.Tensor | None            # KL_k(lp, ref) per token (carries grad), None without ref logprobs
    tis: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # diagnostic (weight, capped, missing)

    def token_loss(self, cfg: PolicyLossConfig) -> torch.Tensor:
        """ℓ_t = w_t·pg_t + β·KL_t − α·H_t: the loss before aggregation (aggregation is linear, so a
        token's share of the loss is its aggregation weight times ℓ_t)."""
        tok = self.pg
        if cfg.kl_coef > 0 and self.kl is not None:
            tok = tok + cfg.kl_coef * self.kl
        if cfg.entropy_coef != 0:
            tok = tok + _masked(self.mask, -cfg.entropy_coef * self.entropy, 0.0)
        return tok


def _masked(mask: torch.Tensor, value: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
    """value where mask else fill — the NaN-safe way to mask an input (see module docstring)."""
    if not isinstance(fill, torch.Tensor):
        fill = torch.full_like(value, fill)
    return torch.where(mask, value, fill)


class PolicyLoss:
    """Callable `LossFn`: `loss, metrics = PolicyLoss(cfg)(logprobs, entropy, mb, ctx)`."""

    def __init__(self, cfg: PolicyLossConfig | None = None) -> None:
        self.cfg = cfg = cfg if cfg is not None else PolicyLossConfig()
        self.objective = OBJECTIVES.get(cfg.loss)
        self.params = cfg.objective_params()
        self.correction_list = cfg.corrections()
        self.band = ClipBand(cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        rules = self.objective.rules
        for c, _ in self.correction_list:
            rules |= c.rules
        self.rules = LossRule(rules)

    def __repr__(self) -> str:
        return f"PolicyLoss({self.cfg!r})"

    def token_terms(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch) -> LossTerms:
        """Every per-token piece of the loss of micro-batch `mb` (module docstring)."""
        cfg = self.cfg
        if mb.advantages is None:
            raise ValueError("PolicyLoss needs mb.advantages")
        if (self.correction_list or cfg.tis) and mb.rollout_logprobs is None:
            raise ValueError(f"algo.correction {[c.name for c, _ in self.correction_list]} needs mb.rollout_logprobs")
        if cfg.kl_coef > 0 and mb.ref_logprobs is None:
            raise ValueError("PolicyLossConfig.kl_coef > 0 needs mb.ref_logprobs (the reference policy's "
                             "logprobs; the loop computes them when algo.kl_coef > 0)")
        T = mb.num_tokens
        if logprobs.shape != (T,) or entropy.shape != (T,):
            raise ValueError(f"logprobs/entropy must be [T={T}], got {tuple(logprobs.shape)} "
                             f"and {tuple(entropy.shape)}")

        # Compute in at least float32 (bf16 exp/ratios are too coarse for clipping decisions).
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        dev = logprobs.device
        mask = mb.loss_mask.to(dev) > 0
        offsets = mb.offsets.to(dev)

        def aux(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=dtype)

        lp = _masked(mask, logprobs.to(dtype), 0.0)
        lp_det = lp.detach()
        ent = _masked(mask, entropy.to(dtype), 0.0)
        adv = _masked(mask, aux(mb.advantages), 0.0)
        # Absent old logprobs: on-policy, ρ ≡ 1 but dρ/dlp = 1, the REINFORCE gradient.
        old = lp_det if mb.old_logprobs is None else _masked(mask, aux(mb.old_logprobs), lp_det)

        obj = self.objective.terms(TokenInputs(lp, old, adv, mask, offsets, cfg.log_ratio_clamp),
                                   self.band, self.params)
        pg, rules = obj.loss, obj.rules
        weight = torch.ones_like(lp_det)
        tis_diag = None
        if mb.rollout_logprobs is not None:
            cin = CorrectionInputs(old, aux(mb.rollout_logprobs), mask, offsets, cfg.log_ratio_clamp)
            for c, params in self.correction_list:
                out = c.terms(cin, params)
                weight, rules = weight * out.weight, rules | out.rules
            diag = CORRECTIONS.get("tis").terms(cin, TisParams(level="token", cap=cfg.tis_cap))
            tis_diag = (diag.weight, (diag.rules & int(LossRule.TIS_TRUNCATED)) > 0,
                        (diag.rules & int(LossRule.NO_ROLLOUT)) > 0)
            if self.correction_list:
                pg = pg * weight

        kl_tok = None
        if mb.ref_logprobs is not None:
            ref = _masked(mask, aux(mb.ref_logprobs), lp_det)
            # where() again: with ref = lp at masked positions KL is 0 there, but an out-of-band
            # value must never reach the sum.
            kl_tok = _masked(mask, kl_penalty(lp, ref, cfg.kl_estimator, log_ratio_clamp=cfg.kl_log_ratio_clamp), 0.0)
        return LossTerms(mask=mask, lp=lp_det, old=old, entropy=ent, pg=pg, ratio=obj.ratio,
                         is_weight=weight, rules=rules, kl=kl_tok, tis=tis_diag)

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        terms = self.token_terms(logprobs, entropy, mb)
        mask = terms.mask

        def agg(tok: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(tok, mask, mb.offsets.to(mask.device), ctx, cfg.loss_agg, cfg.agg_norm_len)

        pg_loss = agg(terms.pg)
        loss = pg_loss
        zero = pg_loss.new_zeros(())
        kl_loss = zero
        if cfg.kl_coef > 0:
            assert terms.kl is not None
            kl_loss = agg(cfg.kl_coef * terms.kl)
            loss = loss + kl_loss
        entropy_loss = zero
        if cfg.entropy_coef != 0:
            entropy_loss = agg(-cfg.entropy_coef * terms.entropy)
            loss = loss + entropy_loss
        metrics: dict[str, Any] = self._metrics(terms, ctx, loss=loss, pg_loss=pg_loss, kl_loss=kl_loss,
                                                entropy_loss=entropy_loss)
        metrics[TOKEN_COLUMN_PREFIX + "is_weight"] = terms.is_weight.detach().float()
        metrics[TOKEN_COLUMN_PREFIX + "loss_rule"] = torch.where(mask, terms.rules, torch.zeros_like(terms.rules))
        return loss, metrics

    def _metrics(self, terms: LossTerms, ctx: LossContext, **losses: torch.Tensor) -> dict[str, float]:
        mask, lp = terms.mask, terms.lp
        with torch.no_grad():
            denom = float(max(int(ctx.num_loss_tokens), 1))
            zeros = torch.zeros_like(lp)

            def tok_mean(x: torch.Tensor) -> torch.Tensor:
                # batch-wide token mean share: Σ_mb m·x / M (sums over micro-batches to the mean)
                return torch.where(mask, x.to(lp.dtype), zeros).sum() / denom

            def has(rule: LossRule) -> torch.Tensor:
                return ((terms.rules & int(rule)) > 0).to(lp.dtype)

            ratio = terms.ratio
            values: dict[str, torch.Tensor] = {k: v.detach() for k, v in losses.items()}
            high, low = has(LossRule.CLIP_HIGH), has(LossRule.CLIP_LOW)
            values["clipfrac"] = tok_mean(torch.maximum(high, low))
            values["clipfrac_high"] = tok_mean(high)
            values["clipfrac_low"] = tok_mean(low)
            values["dual_clipfrac"] = tok_mean(has(LossRule.DUAL_CLIP))
            for rule in LossRule:
                if rule & self.rules:
                    values[f"rule_{RULE_NAMES[rule]}_frac"] = tok_mean(has(rule))
            values["ratio_mean"] = tok_mean(ratio)
            # k3 of KL(π_old ‖ π_θ) from samples of π_old: ρ − 1 − log ρ (≥ 0)
            values["approx_kl"] = tok_mean(kl_penalty(terms.old, lp, "k3"))
            values["entropy"] = tok_mean(terms.entropy.detach())
            if terms.kl is not None:
                values["kl"] = tok_mean(terms.kl.detach())
            if self.correction_list and terms.tis is not None:
                values["is_weight_mean"] = tok_mean(terms.is_weight)
            if terms.tis is not None:
                w, capped, missing = terms.tis
                values["tis_weight_mean"] = tok_mean(w)
                values["tis_capped_frac"] = tok_mean(capped.to(lp.dtype))
                values["tis_missing_frac"] = tok_mean(missing.to(lp.dtype))
            values["num_loss_tokens"] = mask.to(lp.dtype).sum()
            has_tokens = bool(mask.any())
            one = lp.new_ones(())
            values["ratio_max"] = ratio[mask].max() if has_tokens else one
            values["ratio_min"] = ratio[mask].min() if has_tokens else one
            keys = list(values)
            # one device→host transfer for all metrics instead of one .item() per key
            floats = torch.stack([values[k].to(torch.float64).reshape(()) for k in keys]).tolist()
        return dict(zip(keys, floats))


def make_policy_loss(cfg: PolicyLossConfig | None = None) -> PolicyLoss:
    """The `LossFn` for a config (a callable object, so it pickles / prints with its config)."""
    return PolicyLoss(cfg)
