"""PPO-family policy loss implementing `axrl.train.protocol.LossFn`.

Per loss token t (m_t = 1), with lp = log π_θ(x_t) (carries grad), old = log π_old(x_t) (the
trainer's recompute before the update; lp.detach() when absent, i.e. one on-policy update),
roll = log π_rollout(x_t) (inference engine), ref = log π_ref(x_t), A = advantage:

    ρ        = exp(lp − old)                                     importance ratio
    pg_1     = −A · ρ
    pg_2     = −A · clip(ρ, 1 − ε_low, 1 + ε_high)               asymmetric "clip-higher" (DAPO)
    pg       = max(pg_1, pg_2)                                   pessimistic PPO surrogate
    dual     : if A < 0:  pg = min(pg, −c · A)                   dual-clip PPO (c > 1); bounds the
                                                                 loss when ρ ≫ 1 on a bad action
    tis      : pg = w · pg,  w = min(exp(old − roll), C)         truncated importance sampling,
                                                                 w detached (a constant weight):
                                                                 corrects rollout ≠ trainer probs
    ℓ_t      = pg + β · KL_k(lp, ref) − α · H_t                  KL penalty only when β > 0;
                                                                 entropy bonus α (H_t carries grad)

ℓ_t is then aggregated over loss tokens with `cfg.loss_agg` (see `axrl.algo.aggregation`),
normalised by batch-wide counts in `LossContext`, so summing the returned losses (and their
gradients) over micro-batches gives the full-batch loss (and gradient).

Masking: every per-token input is first replaced, with `torch.where`, by a finite stand-in at
positions where loss_mask = 0 (rollout logprobs are NaN there; logprobs may be −inf or junk at
prompt tokens). Multiplying by the mask instead would give 0 · NaN = NaN in the forward and,
worse, NaN gradients through exp(). So masked positions contribute exactly 0 and get 0 gradient.

Gradient (analytic, per loss token, for token-mean; d/d lp, A ≠ 0):
    unclipped branch selected:   −A · ρ · w        (+ β dKL/dlp − α dH/dlp)
    clipped or dual-clipped:     0                 (+ the same KL/entropy terms)
divided by ctx.num_loss_tokens. "Clipped" means pg_2 > pg_1, i.e. A > 0 and ρ > 1 + ε_high, or
A < 0 and ρ < 1 − ε_low; "dual-clipped" means A < 0 and max(pg_1, pg_2) > −c·A.

Metrics (floats). Unless noted, SUMMING a key over the micro-batches of one batch gives the batch
value, because each is normalised by batch-wide counts:
    loss, pg_loss              the loss (with loss_agg) and its policy-gradient part alone
    kl_loss, entropy_loss      β·KL and −α·H parts aggregated with loss_agg (0 when the coef is 0)
    clipfrac                   fraction of loss tokens where pg_2 > pg_1 (/ num_loss_tokens)
    clipfrac_high, clipfrac_low   the A > 0 (ρ above 1+ε_high) and A < 0 (ρ below 1−ε_low) parts
    dual_clipfrac              fraction of loss tokens where the dual clip bound was taken
    ratio_mean                 token mean of ρ
    approx_kl                  token mean of k3 KL(π_old ‖ π_θ) = mean(ρ − 1 − log ρ)
    entropy                    token mean of H_t
    kl                         token mean of KL_k(lp, ref)  (only if ref_logprobs is given)
    tis_weight_mean, tis_capped_frac, tis_missing_frac
                               token mean of w, fraction with exp(old − roll) > C, fraction of
                               loss tokens without a finite rollout logprob (w := 1 there);
                               reported whenever rollout_logprobs is given, applied only if cfg.tis
    num_loss_tokens            raw count of loss tokens in the micro-batch
NOT summable — reduce with max / min (see `reduce_microbatch_metrics`):
    ratio_max, ratio_min       extreme ρ over the micro-batch's loss tokens (1.0 when it has none)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axrl.algo.aggregation import LOSS_AGG_MODES, LossAgg, aggregate_loss
from axrl.algo.kl import KLEstimator, kl_penalty
from axrl.train.protocol import LossContext, PackedBatch

__all__ = ["PolicyLossConfig", "PolicyLoss", "PPOTokenTerms", "make_policy_loss", "ppo_token_loss"]


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the PPO-family loss (module docstring has the formulas).

    clip_low / clip_high: ε_low, ε_high of the ratio band [1 − ε_low, 1 + ε_high].
    dual_clip: c > 1 for dual-clip PPO, None to disable.
    tis / tis_cap: apply truncated importance sampling w = min(exp(old − rollout), tis_cap).
    kl_coef / kl_estimator: β and "k1" | "k2" | "k3" for the KL(π ‖ π_ref) penalty (β > 0 needs
        ref_logprobs). kl_log_ratio_clamp: optional clamp of ref − lp inside the estimator.
    entropy_coef: α of the entropy bonus (subtracted from the loss).
    loss_agg: see `axrl.algo.aggregation`; agg_norm_len: L for "seq-mean-token-sum-norm".
    log_ratio_clamp: lp − old is clamped to [−c, c] before exp, so a wildly off-policy token
        cannot overflow ρ to inf (and inf · 0 → NaN). Tokens beyond it get no gradient from the
        surrogate; ±20 (ρ ∈ [2e-9, 5e8]) never binds in a sane update. None disables.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    tis: bool = False
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_log_ratio_clamp: float | None = None
    entropy_coef: float = 0.0
    loss_agg: LossAgg = "token-mean"
    agg_norm_len: float | None = None
    log_ratio_clamp: float | None = 20.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if not self.tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {self.kl_estimator!r}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}")
        if self.loss_agg == "seq-mean-token-sum-norm" and not (self.agg_norm_len or 0) > 0:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs agg_norm_len > 0")
        if self.log_ratio_clamp is not None and not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp must be > 0 (or None), got {self.log_ratio_clamp}")


@dataclass
class PPOTokenTerms:
    """Per-token pieces of the loss, all [T_mb], 0 at masked positions."""

    pg: torch.Tensor          # policy-gradient loss after dual clip and TIS (grad)
    ratio: torch.Tensor       # ρ (grad)
    clipped_high: torch.Tensor  # bool: A > 0 and the clipped branch was taken
    clipped_low: torch.Tensor   # bool: A < 0 and the clipped branch was taken
    dual_clipped: torch.Tensor  # bool
    tis_weight: torch.Tensor | None   # w before masking (detached); None without rollout logprobs
    tis_capped: torch.Tensor | None   # bool
    tis_missing: torch.Tensor | None  # bool: loss token without a finite rollout logprob


def _masked(mask: torch.Tensor, value: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
    """value where mask else fill — the NaN-safe way to mask an input (see module docstring)."""
    if not isinstance(fill, torch.Tensor):
        fill = torch.full_like(value, fill)
    return torch.where(mask, value, fill)


def ppo_token_loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   cfg: PolicyLossConfig, rollout: torch.Tensor | None = None) -> PPOTokenTerms:
    """The clipped / dual-clipped / TIS-weighted surrogate per token. Inputs must already be
    finite at masked positions (the caller sanitises with torch.where)."""
    log_ratio = lp - old
    if cfg.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    pg_1 = -adv * ratio
    pg_2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    # torch.where instead of torch.maximum: at a tie maximum splits the gradient in halves;
    # here ties keep the unclipped branch, so "clipped" ⇔ zero surrogate gradient, exactly.
    clipped = (pg_2 > pg_1) & mask
    pg = torch.where(clipped, pg_2, pg_1)
    if cfg.dual_clip is not None:
        pg_3 = -adv * cfg.dual_clip
        dual = (adv < 0) & (pg > pg_3) & mask
        pg = torch.where(dual, pg_3, pg)
    else:
        dual = torch.zeros_like(mask)

    tis_weight = tis_capped = tis_missing = None
    if rollout is not None:
        available = torch.isfinite(rollout) & mask
        tis_missing = mask & ~available
        # old − rollout is finite wherever `available`; elsewhere use 0 → raw weight 1.
        diff = torch.where(available, old.detach() - torch.where(available, rollout, 0.0),
                           torch.zeros_like(old))
        raw = torch.exp(diff)  # may be inf for a huge diff; min() below maps that to the cap
        tis_capped = (raw > cfg.tis_cap) & available
        tis_weight = raw.clamp(max=cfg.tis_cap).detach()
        if cfg.tis:
            pg = pg * tis_weight
    pg = torch.where(mask, pg, torch.zeros_like(pg))
    return PPOTokenTerms(pg=pg, ratio=ratio, clipped_high=clipped & (adv > 0),
                       clipped_low=clipped & (adv < 0), dual_clipped=dual, tis_weight=tis_weight,
                       tis_capped=tis_capped, tis_missing=tis_missing)


class PolicyLoss:
    """Callable `LossFn`: `loss, metrics = PolicyLoss(cfg)(logprobs, entropy, mb, ctx)`."""

    def __init__(self, cfg: PolicyLossConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else PolicyLossConfig()

    def __repr__(self) -> str:
        return f"PolicyLoss({self.cfg!r})"

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        if mb.advantages is None:
            raise ValueError("PolicyLoss needs mb.advantages")
        if cfg.tis and mb.rollout_logprobs is None:
            raise ValueError("PolicyLossConfig.tis=True needs mb.rollout_logprobs")
        if cfg.kl_coef > 0 and mb.ref_logprobs is None:
            raise ValueError("PolicyLossConfig.kl_coef > 0 needs mb.ref_logprobs")
        T = mb.num_tokens
        if logprobs.shape != (T,) or entropy.shape != (T,):
            raise ValueError(f"logprobs/entropy must be [T={T}], got {tuple(logprobs.shape)} "
                             f"and {tuple(entropy.shape)}")

        # Compute in at least float32 (bf16 exp/ratios are too coarse for clipping decisions).
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        dev = logprobs.device
        mask = mb.loss_mask.to(dev) > 0

        def aux(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=dtype)

        lp = _masked(mask, logprobs.to(dtype), 0.0)
        lp_det = lp.detach()
        ent = _masked(mask, entropy.to(dtype), 0.0)
        adv = _masked(mask, aux(mb.advantages), 0.0)
        # Absent old logprobs: on-policy, ρ ≡ 1 but dρ/dlp = 1, the REINFORCE gradient.
        old = lp_det if mb.old_logprobs is None else _masked(mask, aux(mb.old_logprobs), lp_det)
        rollout = None if mb.rollout_logprobs is None else aux(mb.rollout_logprobs)

        terms = ppo_token_loss(lp, old, adv, mask, cfg, rollout)

        def agg(tok: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(tok, mask, mb.offsets, ctx, cfg.loss_agg, cfg.agg_norm_len)

        pg_loss = agg(terms.pg)
        loss = pg_loss
        zero = pg_loss.new_zeros(())
        kl_tok = None
        if mb.ref_logprobs is not None:
            ref = _masked(mask, aux(mb.ref_logprobs), lp_det)
            # where() again: with ref = lp at masked positions KL is 0 there, but an out-of-band
            # value must never reach the sum.
            kl_tok = _masked(mask, kl_penalty(lp, ref, cfg.kl_estimator,
                                              log_ratio_clamp=cfg.kl_log_ratio_clamp), 0.0)
        kl_loss = zero
        if cfg.kl_coef > 0:
            assert kl_tok is not None
            kl_loss = agg(cfg.kl_coef * kl_tok)
            loss = loss + kl_loss
        entropy_loss = zero
        if cfg.entropy_coef != 0:
            entropy_loss = agg(-cfg.entropy_coef * ent)
            loss = loss + entropy_loss

        metrics = self._metrics(terms, mask, lp_det, old, ent.detach(), kl_tok, ctx,
                                loss=loss, pg_loss=pg_loss, kl_loss=kl_loss,
                                entropy_loss=entropy_loss)
        return loss, metrics

    @staticmethod
    def _metrics(terms: PPOTokenTerms, mask: torch.Tensor, lp: torch.Tensor, old: torch.Tensor,
                 ent: torch.Tensor, kl_tok: torch.Tensor | None, ctx: LossContext,
                 **losses: torch.Tensor) -> dict[str, float]:
        with torch.no_grad():
            denom = float(max(int(ctx.num_loss_tokens), 1))
            fmask = mask.to(lp.dtype)

            def tok_mean(x: torch.Tensor) -> torch.Tensor:
                # batch-wide token mean share: Σ_mb m·x / M (sums over micro-batches to the mean)
                return torch.where(mask, x.to(lp.dtype), torch.zeros_like(lp)).sum() / denom

            ratio = terms.ratio.detach()
            values: dict[str, torch.Tensor] = {k: v.detach() for k, v in losses.items()}
            values["clipfrac"] = tok_mean((terms.clipped_high | terms.clipped_low).to(lp.dtype))
            values["clipfrac_high"] = tok_mean(terms.clipped_high.to(lp.dtype))
            values["clipfrac_low"] = tok_mean(terms.clipped_low.to(lp.dtype))
            values["dual_clipfrac"] = tok_mean(terms.dual_clipped.to(lp.dtype))
            values["ratio_mean"] = tok_mean(ratio)
            # k3 of KL(π_old ‖ π_θ) from samples of π_old: ρ − 1 − log ρ (≥ 0)
            values["approx_kl"] = tok_mean(kl_penalty(old, lp, "k3"))
            values["entropy"] = tok_mean(ent)
            if kl_tok is not None:
                values["kl"] = tok_mean(kl_tok.detach())
            if terms.tis_weight is not None:
                values["tis_weight_mean"] = tok_mean(terms.tis_weight)
                values["tis_capped_frac"] = tok_mean(terms.tis_capped.to(lp.dtype))
                values["tis_missing_frac"] = tok_mean(terms.tis_missing.to(lp.dtype))
            values["num_loss_tokens"] = fmask.sum()
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
