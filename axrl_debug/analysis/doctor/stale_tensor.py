"""`stale_tensor`: one layer's tensor or one expert differs between engine and trainer. Two
localisations: the error concentrates on tokens routed through one (layer, expert) — measured on
tokens whose routing agrees, so flips downstream do not blur it — or routing agrees exactly in
every layer before one and flips from it on (the first flipping layer; attention spreads a token's
error over later positions, routing localises it)."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MIN_RATIO = 4.0      # |Δ| routed through the expert over |Δ| elsewhere
MIN_LEAD = 1.5       # … and over the runner-up's ratio


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None:
        return []
    out = []
    if p.experts:
        best = p.experts[0]
        second = p.experts[1]["ratio"] if len(p.experts) > 1 else 1.0
        if best["ratio"] >= MIN_RATIO and best["ratio"] >= MIN_LEAD * second:
            conf = min(0.95, 0.6 + 0.05 * min(best["ratio"] / MIN_RATIO, 5.0) + 0.05 * (not p.before_first_sync))
            out.append(Finding(
                "stale_tensor", conf,
                {"layer": best["layer"], "expert": best["expert"], "op": "expert_out", "experts": p.experts,
                 "first_flip_layer": p.first_flip_layer, "layer_flip_rate": p.layer_flip_rate,
                 "clean_before_first_sync": not p.before_first_sync},
                f"layer {best['layer']}, expert {best['expert']}: tokens routed through it have mean |Δ| "
                f"{best['mean_abs_routed']:.3g} vs {best['mean_abs_other']:.3g} elsewhere ({best['ratio']:.1f}×, "
                f"next {second:.1f}×); the engine's copy of that expert differs from the trainer's",
                f"axrl-debug bisect {ctx.run} --step {p.steps[0]}", p.steps))
    elif p.first_flip_layer not in (None, 0) and p.agree is not None and p.agree > ctx.floor():
        layer = p.first_flip_layer
        out.append(Finding(
            "stale_tensor", 0.55,
            {"layer": layer, "op": "router", "first_flip_layer": layer, "layer_flip_rate": p.layer_flip_rate},
            f"routing agrees exactly in layers 0–{layer - 1} and flips from layer {layer} on: a tensor of layer "
            f"{layer} (or the end of layer {layer - 1}) differs",
            f"axrl-debug bisect {ctx.run} --step {p.steps[0]}", p.steps))
    return out
