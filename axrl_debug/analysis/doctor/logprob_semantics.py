"""`logprob_semantics`: the engine's logprobs are of another distribution than the trainer's
(temperature, top-p/top-k processing, penalties): Δ has one sign and its size follows the token's
probability, as log-softmax(z/T') − log-softmax(z/T) does."""

from __future__ import annotations

import math

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MIN_SIGN = 0.7     # |mean Δ| / mean |Δ|
MIN_CORR = 0.6     # |Pearson r| of Δ with the rollout logprob


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None or not (p.sign_consistency >= MIN_SIGN and math.isfinite(p.prob_corr) and abs(p.prob_corr) >= MIN_CORR):
        return []
    conf = min(0.9, 0.5 + 0.2 * p.sign_consistency + 0.2 * abs(p.prob_corr))
    return [Finding(
        "logprob_semantics", conf,
        {"sign_consistency": p.sign_consistency, "corr_delta_rollout_logprob": p.prob_corr},
        f"Δ has one sign ({100 * p.sign_consistency:.0f} % consistent) and follows the token's probability "
        f"(r = {p.prob_corr:.2f}): the engine reports logprobs of another distribution (temperature, top-p/top-k)",
        f"axrl-debug mismatch {ctx.run} --step {p.steps[0]}", p.steps)]
