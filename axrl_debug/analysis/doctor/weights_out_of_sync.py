"""`weights_out_of_sync`: the whole engine ran other weights than the trainer's version. The error is
everywhere — on tokens routed alike too, on first and later tokens — with no single expert or
layer standing out; it starts at a sync boundary (steps before the first sync are clean) or jumps
at one.

Or it is there from the first step on and gross (`Profile.gross`: nats a token, beyond any
precision's rounding): the engine never computed the trainer's weights — a load or weight push that
left tensors wrong, another checkpoint or another model. An imported run cannot tell AxRL about its
framework's own pushes (TRL pushes into its colocated vLLM before the first generation; on vLLM's
CPU build that push leaves the MoE experts unpacked and the engine samples near-uniformly), so
"before the first sync" is not evidence of the right weights there."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

MAX_EXPERT_RATIO = 3.0   # no (layer, expert) concentrates the error more than this


def detect(ctx: Context) -> list[Finding]:
    p = ctx.profile
    if p is None:
        return []
    if p.before_first_sync:
        return _never_synced(ctx, p) if p.gross else []
    everywhere = (p.agree is None or p.agree > ctx.floor()) and p.later_tokens > ctx.floor()
    spread = _spread(p)
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


def _spread(p) -> bool:
    """No (layer, expert) concentrates the error: the whole engine, not one tensor."""
    return not p.experts or p.experts[0]["ratio"] < MAX_EXPERT_RATIO


def _never_synced(ctx: Context, p) -> list[Finding]:
    """The gross error from the first step on (module doc)."""
    spread = _spread(p)
    conf = 0.65 + 0.1 * spread + 0.05 * (p.later_tokens > ctx.floor() and p.first_token > ctx.floor())
    return [Finding(
        "weights_out_of_sync", conf,
        {"steps_outside": p.steps, "mean_abs": p.mean_abs, "engine_mean_logprob": p.rollout_mean,
         "trainer_mean_logprob": p.trainer_mean, "first_token_mean_abs": p.first_token,
         "decode_tokens_mean_abs": p.later_tokens, "from_first_weights": True, "gross": True},
        f"from the first step on (step {p.steps[0]}), the engine's logprobs differ from the trainer's by mean |Δ| "
        f"{p.mean_abs:.3g} nats a token (engine's mean logprob of the sampled tokens {p.rollout_mean:.3g}, the "
        f"trainer's {p.trainer_mean:.3g}) on every kind of token: far beyond any precision's rounding, so the engine "
        "did not compute the trainer's weights — a weight load or push that left tensors wrong (a framework's own "
        "push before its first generation counts), another checkpoint or another model",
        f"axrl-debug mismatch {ctx.run} --step {p.steps[0]}", p.steps)]
