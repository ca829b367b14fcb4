"""`prefill_decode`: the engine's prefill and decode paths disagree — the error sits on the first
generated token of each turn (the token the prefill's last position predicts)."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context, ratio
from axrl_debug.analysis.doctor.finding import Finding

MIN_RATIO = 4.0     # first-token |Δ| over decode-token |Δ|
MIN_SHARE = 0.3     # and the first tokens carry this much of Σ|Δ|


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None:
        return []
    r = ratio(p.first_token, p.later_tokens, ctx.envelope.floor_mean_abs)
    if not (r >= MIN_RATIO and p.first_token_share >= MIN_SHARE):
        return []
    later_inside = p.later_tokens <= ctx.floor()
    conf = min(0.95, 0.6 + 0.05 * min(r, 6.0) + (0.05 if later_inside else 0.0))
    if p.after_turn_boundary(ctx.floor()):  # a prefill fault hits the first turn's first token too
        conf -= 0.3
    return [Finding(
        "prefill_decode", conf,
        {"first_token_mean_abs": p.first_token, "decode_tokens_mean_abs": p.later_tokens, "ratio": r,
         "first_token_share": p.first_token_share, "decode_tokens_inside_envelope": later_inside},
        f"the first generated token of each turn carries {100 * p.first_token_share:.0f} % of Σ|Δ|: mean |Δ| "
        f"{p.first_token:.3g} vs {p.later_tokens:.3g} on decode tokens ({r:.1f}×)",
        ctx.cmd("explain", p.steps[0]) + " --worst 1", p.steps)]
