"""`precision` and `within_envelope`: the findings of a run whose every step is inside its
envelope — `precision` when that envelope is a low-precision rollout's (the mismatch is real and
expected: it is what that precision costs), `within_envelope` otherwise."""

from __future__ import annotations

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

LOW = ("bf16", "bfloat16", "fp16", "float16", "fp8")


def detect(ctx: Context) -> list[Finding]:
    env = ctx.envelope
    worst = max(ctx.steps, key=lambda s: ctx.per_step[s].get("envelope_ratio") or 0.0) if ctx.steps else None
    evidence = {"envelope": {"mean_abs": env.mean_abs, "max_abs": env.max_abs, "source": env.source,
                             "precision": env.precision},
                "worst_step": worst, "worst_ratio": ctx.per_step[worst].get("envelope_ratio") if worst is not None else None}
    if ctx.flagged:
        return []
    if env.precision in LOW:
        return [Finding("precision", 0.7, evidence,
                        f"every step is inside the {env.precision} rollout's envelope (mean |Δ| ≤ {env.mean_abs:.3g}): "
                        "the mismatch is that precision's rounding, uniform over tokens",
                        # bisect shows which op's rounding carries it, against each op's own floor
                        f"axrl-debug bisect {ctx.run} --step {worst}", ctx.steps)]
    return [Finding("within_envelope", 0.9, evidence,
                    f"every step's mismatch is inside the run's envelope (mean |Δ| ≤ {env.mean_abs:.3g}, "
                    f"max |Δ| ≤ {env.max_abs:.3g}, from {env.source})", ctx.cmd("summary"), ctx.steps)]
