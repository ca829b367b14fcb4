"""`kv_cache_precision`: the engine's KV cache holds keys/values at a lower precision than the
trainer computes with. The error is there from the first weights on (no sync needed), on every kind
of token, larger on decode tokens (which read every key from the cache) than on the first token of
a turn, and it grows (or at least does not shrink) with the position in the sequence."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context, ratio
from axrl_debug.analysis.doctor.finding import Finding


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    # a cache's rounding moves logprobs by far less than a nat: a gross error is another model's
    if p is None or not p.before_first_sync or p.later_tokens <= ctx.floor() or p.gross:
        return []
    growth = ratio(p.late, p.early, ctx.envelope.floor_mean_abs)
    decode_heavier = p.later_tokens >= p.first_token
    conf = 0.5 + 0.1 * decode_heavier + 0.15 * (growth >= 1.5) + 0.05 * (p.agree is None or p.agree > ctx.floor())
    if p.flip_share is not None and p.flip_share > 0.4:  # the error sits where routing flipped: routing_flips
        conf -= 0.2
    if p.after_turn_boundary(ctx.floor()):  # a low-precision cache errs in the first turn too
        conf -= 0.3
    # an envelope that assumed fp32 cannot tell a bf16 cache from a whole bf16 engine
    unstated = not ctx.envelope.calibration.get("precision_stated", True)
    conf -= 0.15 * unstated
    return [Finding(
        "kv_cache_precision", conf,
        {"mean_abs_first_quarter_positions": p.early, "mean_abs_last_quarter_positions": p.late,
         "position_growth": growth, "first_token_mean_abs": p.first_token, "decode_tokens_mean_abs": p.later_tokens,
         "from_first_weights": True},
        f"the error is there from the initial weights on (step {p.steps[0]}, before any sync), on every kind of "
        f"token (decode tokens: mean |Δ| {p.later_tokens:.3g}, each turn's first token: {p.first_token:.3g}; last vs "
        f"first quarter of positions {growth:.2f}×) with no routing, expert or first-token concentration: the "
        "engine computes attention from keys/values held at a lower precision"
        + ("; or, as the run states no precision and fp32 was assumed, the whole engine computes at a lower "
           "precision (state it and re-run doctor)" if unstated else ""),
        f"axrl-debug bisect {ctx.run} --step {p.steps[0]}", p.steps)]   # names `attn` at the decode positions
