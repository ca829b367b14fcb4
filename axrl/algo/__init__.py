"""RL objectives: advantage estimators, KL estimators, loss aggregation and the PPO-family loss.

Public API::

    group_normalized_advantages(rewards, group_ids, *, normalize_std=True, eps=1e-6, unbiased=False)
    grpo_advantages(...)            same
    reinforce_advantages(rewards)
    compute_advantages(rewards, group_ids=None, *, estimator="grpo"|"dr_grpo"|"reinforce", ...)
    token_advantages(sample_advantages, offsets, loss_mask) -> [T]
    kl_penalty(logprobs, ref_logprobs, estimator="k3", *, log_ratio_clamp=None); kl_k1/k2/k3
    aggregate_loss(token_loss, loss_mask, offsets, ctx, mode="token-mean", norm_len=None)
    PolicyLossConfig(loss=..., correction=..., ...); PolicyLoss(cfg); make_policy_loss(cfg) -> LossFn
    PolicyLoss.token_terms(logprobs, entropy, mb) -> LossTerms (the per-token pieces)
    OBJECTIVES, CORRECTIONS: the registries behind `algo.loss` / `algo.correction`; LossRule codes
    reduce_microbatch_metrics(rows) -> dict
"""

from axrl.algo.advantages import (
    AdvantageEstimator,
    compute_advantages,
    group_normalized_advantages,
    grpo_advantages,
    reinforce_advantages,
    token_advantages,
)
from axrl.algo.aggregation import LOSS_AGG_MODES, LossAgg, aggregate_loss, aggregation_weights, segment_sum
from axrl.algo.kl import KLEstimator, kl_k1, kl_k2, kl_k3, kl_penalty
from axrl.algo.corrections import CORRECTIONS
from axrl.algo.losses import LossTerms, PolicyLoss, PolicyLossConfig, make_policy_loss
from axrl.algo.objectives import OBJECTIVES
from axrl.algo.terms import RULE_NAMES, LossRule
from axrl.train.metrics import reduce_microbatch_metrics

__all__ = [
    "AdvantageEstimator",
    "compute_advantages",
    "group_normalized_advantages",
    "grpo_advantages",
    "reinforce_advantages",
    "token_advantages",
    "LOSS_AGG_MODES",
    "LossAgg",
    "aggregate_loss",
    "aggregation_weights",
    "segment_sum",
    "KLEstimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "CORRECTIONS",
    "OBJECTIVES",
    "LossRule",
    "LossTerms",
    "RULE_NAMES",
    "PolicyLoss",
    "PolicyLossConfig",
    "make_policy_loss",
    "reduce_microbatch_metrics",
]
