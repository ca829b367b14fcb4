"""`logprob_semantics`: the engine's logprobs are of another distribution than the trainer's
(temperature, top-p/top-k processing, penalties): Δ follows the token's probability, as
log-softmax(z/T') − log-softmax(z/T) does — with one sign (a filter or penalty that moves every
sampled token's logprob one way), or, for another temperature, nearly linearly (|r| ≥ 0.9) in both
directions (likely tokens one way, unlikely ones the other) from the first weights on. A weight
update looks like a temperature change too (an entropy bonus flattens the distribution), so the
second reading needs the error before any sync: weights_out_of_sync has none there."""

from __future__ import annotations

import math

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MIN_SIGN = 0.7     # |mean Δ| / mean |Δ|
MIN_CORR = 0.6     # |Pearson r| of Δ with the rollout logprob
STRONG_CORR = 0.9  # |r| that names another temperature without one sign (measured: 0.96 for T 0.7 → 1)


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None or not math.isfinite(p.prob_corr):
        return []
    one_sign = p.sign_consistency >= MIN_SIGN and abs(p.prob_corr) >= MIN_CORR
    if not (one_sign or (p.before_first_sync and abs(p.prob_corr) >= STRONG_CORR)):
        return []
    conf = min(0.9, 0.5 + 0.2 * p.sign_consistency + 0.2 * abs(p.prob_corr))
    return [Finding(
        "logprob_semantics", conf,
        {"sign_consistency": p.sign_consistency, "corr_delta_rollout_logprob": p.prob_corr},
        f"Δ follows the token's probability (r = {p.prob_corr:.2f}; sign {100 * p.sign_consistency:.0f} % consistent)"
        ": the engine reports logprobs of another distribution than it samples from (temperature, top-p/top-k)",
        f"axrl-debug mismatch {ctx.run} --step {p.steps[0]}", p.steps)]
