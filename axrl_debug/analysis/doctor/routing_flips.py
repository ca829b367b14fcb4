"""`routing_flips`: engine and trainer routed tokens to different experts (R3 off) and the error
sits on those tokens; tokens routed alike are near the floor. Flips in every layer from the first
(a noisy router), not from one layer on (that localises a stale tensor instead)."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context, ratio
from axrl_debug.analysis.doctor.finding import Finding

MIN_RATIO = 3.0     # |Δ| of flipped tokens over agreeing ones (attention carries some of it to agreeing ones)
MIN_SHARE = 0.4     # share of Σ|Δ| on flipped tokens


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None or p.flip is None or not p.flip_tokens:
        return []
    r = ratio(p.flip, p.agree, ctx.envelope.floor_mean_abs)
    if not (r >= MIN_RATIO and p.flip_share >= MIN_SHARE):
        return []
    layers = [l for l, x in enumerate(p.layer_flip_rate) if x > 0]
    conf = (0.55 + 0.1 * (p.first_flip_layer == 0) + 0.1 * (len(layers) > 1) + 0.1 * (p.flip_share > 0.6)
            + 0.1 * (p.agree <= ctx.floor()))
    if p.after_turn_boundary(ctx.floor()):  # a noisy router flips in the first turn too
        conf -= 0.3
    return [Finding(
        "routing_flips", conf,
        {"flip_tokens": p.flip_tokens, "mean_abs_flipped": p.flip, "mean_abs_agreeing": p.agree, "ratio": r,
         "flip_share": p.flip_share, "layer_flip_rate": p.layer_flip_rate, "first_flip_layer": p.first_flip_layer},
        f"{p.flip_tokens} tokens predicted from positions routed differently by engine and trainer carry "
        f"{100 * p.flip_share:.0f} % of Σ|Δ| (mean |Δ| {p.flip:.3g} vs {p.agree:.3g} where routing agrees), flips in "
        f"layers {layers}: enable routing replay (r3: true)",
        f"axrl-debug bisect {ctx.run} --step {p.steps[0]}", p.steps)]
