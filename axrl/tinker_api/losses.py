"""Tinker's built-in loss functions as AxRL `LossFn`s: token-level and summed (no normalisation).

Per-position inputs live on the packed rows (`batch.pack`): `weights` (cross_entropy; carried in
the advantages column, −Σ w·lp being REINFORCE with A = w), `advantages` and the sampler's
`logprobs` (the RL losses, in the rollout-logprob column). A position that is not trained carries weight 0 /
advantage 0, so it adds nothing; the sums run over every row of the batch.

    cross_entropy        ℓ = −Σ w · lp
    importance_sampling  ℓ = −Σ exp(lp − q) · A                       (q: sampler logprob)
    ppo                  ℓ = Σ max(−A·r, −A·clip(r, lo, hi)),  r = exp(lp − q)
    cispo                ℓ = −Σ sg(clip(r, lo, hi)) · A · lp
    dro                  ℓ = −Σ (A · lp − β/2 · (lp − q)²)          (the square where q is known)

ppo and cispo are the repo's own objectives (`axrl.algo.objectives`) with the ratio taken against
the sampler's logprobs and the band [clip_low_threshold, clip_high_threshold] (default 0.8, 1.2).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from axrl.algo.objectives.cispo import cispo
from axrl.algo.objectives.ppo import ppo
from axrl.algo.registry import NoParams
from axrl.algo.terms import ClipBand, TokenInputs
from axrl.tinker_api.errors import UserError
from axrl.train.protocol import LossContext, PackedBatch

#: what each loss reads from the datums (checked before any work)
NEEDS = {"cross_entropy": ("weights",), "importance_sampling": ("advantages", "logprobs"),
         "ppo": ("advantages", "logprobs"), "cispo": ("advantages", "logprobs"), "dro": ("advantages", "logprobs")}
#: loss_fn_config keys each loss accepts
CONFIG = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold"),
          "cispo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}
NOT_SUPPORTED = {"stable_reinforce": "it needs the sampler's stability records, which AxRL does not keep",
                 "gspo": "use ppo/cispo, or AxRL's own `axrl train` with algo.loss: gspo",
                 "custom": "server-side custom losses are not run by AxRL (the SDK's client-side "
                           "forward_backward_custom works: it sends cross_entropy-shaped requests)"}

TokenLoss = Callable[[torch.Tensor, PackedBatch, dict[str, float]], torch.Tensor]


def check_loss(name: str, config: dict[str, Any]) -> dict[str, float]:
    """The loss's numeric config, or UserError naming the unknown loss / key."""
    if name in NOT_SUPPORTED:
        raise UserError(f"loss_fn {name!r} is not supported by AxRL: {NOT_SUPPORTED[name]}")
    if name not in NEEDS:
        raise UserError(f"unknown loss_fn {name!r}; AxRL supports {sorted(NEEDS)}")
    unknown = sorted(set(config) - set(CONFIG[name]))
    if unknown:
        raise UserError(f"loss_fn_config[{unknown[0]!r}]: not a parameter of {name} (it takes {list(CONFIG[name])})")
    bad = [k for k, v in config.items() if not isinstance(v, (int, float))]
    if bad:
        raise UserError(f"loss_fn_config[{bad[0]!r}] must be a number")
    return {k: float(v) for k, v in config.items()}


def _band(cfg: dict[str, float]) -> ClipBand:
    return ClipBand(low=1.0 - cfg.get("clip_low_threshold", 0.8), high=cfg.get("clip_high_threshold", 1.2) - 1.0)


def _inputs(lp: torch.Tensor, mb: PackedBatch) -> TokenInputs:
    q = torch.nan_to_num(mb.rollout_logprobs, nan=0.0) if mb.rollout_logprobs is not None else lp.detach()
    adv = mb.advantages if mb.advantages is not None else torch.zeros_like(lp)
    mask = torch.ones_like(lp, dtype=torch.bool)
    return TokenInputs(lp=lp, old=q, adv=adv, mask=mask, offsets=mb.offsets, log_ratio_clamp=None)


def _cross_entropy(lp: torch.Tensor, mb: PackedBatch, cfg: dict[str, float]) -> torch.Tensor:
    # the datum weights travel in the advantages column (wire.pack: for cross_entropy A = w)
    return -(lp * mb.advantages)


def _importance_sampling(lp: torch.Tensor, mb: PackedBatch, cfg: dict[str, float]) -> torch.Tensor:
    x = _inputs(lp, mb)
    return -(torch.exp(lp - x.old) * x.adv)


def _ppo(lp: torch.Tensor, mb: PackedBatch, cfg: dict[str, float]) -> torch.Tensor:
    return ppo(_inputs(lp, mb), _band(cfg), NoParams()).loss


def _cispo(lp: torch.Tensor, mb: PackedBatch, cfg: dict[str, float]) -> torch.Tensor:
    return cispo(_inputs(lp, mb), _band(cfg), NoParams()).loss


def _dro(lp: torch.Tensor, mb: PackedBatch, cfg: dict[str, float]) -> torch.Tensor:
    x = _inputs(lp, mb)
    beta = cfg.get("beta", 0.05)
    # the quadratic term only where the sampler's logprob is known (not on prompt positions)
    sampled = ~torch.isnan(mb.rollout_logprobs) if mb.rollout_logprobs is not None else torch.zeros_like(x.mask)
    return -(x.adv * lp - torch.where(sampled.to(lp.device), 0.5 * beta * (lp - x.old) ** 2, torch.zeros_like(lp)))


TOKEN_LOSSES: dict[str, TokenLoss] = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling,
                                      "ppo": _ppo, "cispo": _cispo, "dro": _dro}


class ServiceLoss:
    """`LossFn` of one forward_backward call: the summed token loss over the rows that belong to
    datums (row 0 of each sequence predicts nothing and is excluded), plus the per-token loss
    as the column `tokens/elementwise_loss` (the SDK's `elementwise_loss` output)."""

    def __init__(self, name: str, config: dict[str, float]) -> None:
        self.name, self.config, self.fn = name, config, TOKEN_LOSSES[name]

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, Any]]:
        rows = datum_rows(mb).to(logprobs.device)
        per_token = torch.where(rows, self.fn(logprobs, mb, self.config), torch.zeros_like(logprobs))
        return per_token.sum(), {"tokens/elementwise_loss": per_token.detach(), "tokens/logprobs": logprobs.detach(),
                                  "tokens/entropy": entropy.detach()}


def datum_rows(batch: PackedBatch) -> torch.Tensor:
    """bool [T]: rows that are a datum position (every row but each sequence's first)."""
    rows = torch.ones(batch.num_tokens, dtype=torch.bool)
    rows[batch.offsets[:-1]] = False
    return rows
