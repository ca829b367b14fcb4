"""`context_mismatch`: the engine conditioned on other tokens than the trainer trains on —
re-tokenisation or template re-rendering (the trace's `/tokens/drift` flags), black-box drift spans,
or, with no drift recorded, Δ that starts after the first turn boundary: every sample's first turn
is inside the envelope (the engine computed right on the context it built itself) and the turns it
was given a context assembled by the agent are not. Re-executed in hypotheses.py: the recorded
context (the trainer's tokens) vs the context variants of context_variants.py."""

from __future__ import annotations

import numpy as np

from axrl_debug.analysis.doctor.context import Context, mean
from axrl_debug.analysis.doctor.finding import Finding


def detect(ctx: Context) -> list[Finding]:
    return _drift(ctx) + _turn_boundary(ctx)


def _drift(ctx: Context) -> list[Finding]:
    """The trace flags drift spans: compare Δ on the drifted samples with the others."""
    drifted, in_drift, clean, steps = 0, [], [], []
    for s in ctx.steps:
        v = ctx.views[s]
        if v.drift is None or not (v.drift != 0).any():
            continue
        steps.append(s)
        drifted += int((v.drift != 0).sum())
        rows = np.unique(v.sample_row[v.drift != 0])
        in_sample = np.isin(v.sample_row, rows)
        d = ctx.engine_delta(v)
        in_drift.append(d[in_sample])
        clean.append(d[~in_sample])
    if not steps:
        return []
    a = mean(np.concatenate(in_drift))
    b = mean(np.concatenate(clean)) if clean else float("nan")
    outside = np.isfinite(a) and a > ctx.floor()
    conf = 0.9 if outside else 0.5
    return [Finding(
        "context_mismatch", conf,
        {"drift_tokens": drifted, "mean_abs_delta_drifted_samples": a, "mean_abs_delta_other_samples": b},
        f"{drifted} tokens of the trained streams differ from what the engine was given (drift); "
        f"mean |Δ| on those samples {a:.3g} vs {b:.3g} elsewhere",
        ctx.cmd("summary"), steps)]


def _turn_boundary(ctx: Context) -> list[Finding]:
    """No drift recorded: Δ inside the envelope on every first turn, outside after the boundary."""
    p = ctx.profile
    if p is None or not p.after_turn_boundary(ctx.floor()):
        return []
    return [Finding(
        "context_mismatch", 0.8,
        {"first_turn_mean_abs": p.first_turn, "later_turns_mean_abs": p.later_turns,
         "later_turns_first_token_mean_abs": p.later_first_token, "floor_mean_abs": ctx.floor()},
        f"every sample's first turn is inside the envelope (mean |Δ| {p.first_turn:.3g}) and the turns after a "
        f"turn boundary are not ({p.later_turns:.3g}; their first tokens {p.later_first_token:.3g}): the engine "
        "conditioned on another context than the stream the trainer trains on (template re-rendering, "
        "re-tokenisation, truncation)",
        f"axrl-debug replay {ctx.run} --step {p.steps[0]} --rollout", p.steps)]
