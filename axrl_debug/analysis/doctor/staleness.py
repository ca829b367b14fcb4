"""`staleness`: an asynchronous run whose policy drift since the generating version dominates the
mismatch. From the trace's engine/staleness split (`/tokens/behaviour_train_logprob`):
Δ = Δ_engine + Δ_staleness. The engine part is judged against the envelope (numerics); the staleness
part against the trust region every ratio-based objective assumes: a token whose staleness ratio
exp(Δ_staleness) leaves [1/(1+TRUST), 1+TRUST] is trained far off-policy."""

from __future__ import annotations

import math

import numpy as np

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

TRUST = 0.2                 # the default PPO clip band: log(1.2) = 0.18 nats
MAX_OUTSIDE_SHARE = 0.01    # more than 1 % of the split tokens outside it is a finding


def split(ctx: Context, step: int) -> dict[str, float] | None:
    """Mean |Δ_engine|, mean |Δ_staleness|, the staleness share of Σ|Δ| and the share of tokens whose
    staleness ratio leaves the trust region (None without the split column)."""
    v = ctx.views[step]
    if v.behaviour is None:
        return None
    beh = v.behaviour.astype(np.float64)
    m = v.analysed & np.isfinite(beh)
    if not m.any():
        return None
    eng = beh[m] - v.rollout[m].astype(np.float64)
    stale = v.old[m].astype(np.float64) - beh[m]
    total = np.abs(eng + stale).sum()
    sign = np.sign(eng + stale)
    lag = v.policy_version - v.version[m]
    return {"split_tokens": int(m.sum()), "engine_mean_abs": float(np.abs(eng).mean()),
            "staleness_mean_abs": float(np.abs(stale).mean()),
            "staleness_share": float((sign * stale).sum() / total) if total > 0 else 0.0,
            "outside_trust_share": float((np.abs(stale) > math.log1p(TRUST)).mean()),
            "version_lag_max": int(lag.max()) if len(lag) else 0}


def detect(ctx: Context) -> list[Finding]:
    rows = {s: ctx.per_step[s].get("split") for s in ctx.steps}
    rows = {s: r for s, r in rows.items() if r}
    bad = {s: r for s, r in rows.items() if r["outside_trust_share"] > MAX_OUTSIDE_SHARE and r["staleness_share"] > 0.5}
    if not bad:
        return []
    worst = max(bad, key=lambda s: bad[s]["staleness_mean_abs"])
    r = bad[worst]
    conf = min(0.95, 0.6 + 0.4 * r["staleness_share"])
    return [Finding(
        "staleness", conf,
        {"per_step": bad, "worst_step": worst, "trust_region": TRUST},
        f"the staleness part carries {100 * r['staleness_share']:.0f} % of Σ|Δ| at step {worst} (mean |Δ_staleness| "
        f"{r['staleness_mean_abs']:.3g} vs mean |Δ_engine| {r['engine_mean_abs']:.3g}); "
        f"{100 * r['outside_trust_share']:.1f} % of tokens are outside the ±{TRUST:g} ratio band from staleness alone "
        f"(version lag up to {r['version_lag_max']})",
        ctx.cmd("mismatch", worst), sorted(bad))]
