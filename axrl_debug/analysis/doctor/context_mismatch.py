"""`context_mismatch`: the engine conditioned on other tokens than the trainer trains on —
re-tokenisation or template re-rendering (the trace's `/tokens/drift` flags), black-box drift spans —
and the mismatch sits on the drifted samples."""

from __future__ import annotations

import numpy as np

from axrl_debug.analysis.doctor.context import Context, mean
from axrl_debug.analysis.doctor.finding import Finding


def detect(ctx: Context) -> list[Finding]:
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
