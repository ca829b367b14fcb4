"""`weights_out_of_sync`: the whole engine ran other weights than the trainer's version. The error is
everywhere — on tokens routed alike too, on first and later tokens — with no single expert or
layer standing out; it starts at a sync boundary (steps before the first sync are clean) or jumps
at one."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MAX_EXPERT_RATIO = 3.0   # no (layer, expert) concentrates the error more than this


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None or p.before_first_sync:
        return []
    everywhere = (p.agree is None or p.agree > ctx.floor()) and p.later_tokens > ctx.floor()
    spread = not p.experts or p.experts[0]["ratio"] < MAX_EXPERT_RATIO
    if not everywhere:
        return []
    clean = [s for s in ctx.steps if s not in p.steps]
    conf = 0.55 + 0.15 * spread + 0.1 * bool(clean) + 0.05 * (p.first_flip_layer in (None, 0))
    versions = {s: ctx.views[s].policy_version for s in p.steps}
    return [Finding(
        "weights_out_of_sync", conf,
        {"steps_outside": p.steps, "steps_inside": clean, "policy_versions": versions,
         "mean_abs_agreeing_routing": p.agree, "first_flip_layer": p.first_flip_layer,
         "top_expert_ratio": p.experts[0]["ratio"] if p.experts else None, "clean_before_first_sync": True},
        f"steps {p.steps} (after a weight sync) are outside the envelope on every kind of token (mean |Δ| "
        f"{p.mean_abs:.3g}; routing-agreeing tokens {p.agree if p.agree is not None else float('nan'):.3g}) while "
        f"{'steps ' + str(clean) + ' are' if clean else 'no step is'} inside: the engine ran other weights than "
        "the version it reported",
        f"axrl-debug bisect {ctx.run} --step {p.steps[0]}", p.steps)]
