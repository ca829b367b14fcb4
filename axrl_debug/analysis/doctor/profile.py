"""Where the engine's part of Δ sits on the flagged steps: positions, routing agreement per layer,
experts, steps and sync boundaries, sign. Computed once; each signature family reads its part."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from axrl_debug.analysis.doctor.context import Context, mean, ratio


#: nats per token. The largest rounding mismatch measured in this repository is ~0.02 (a bf16 vLLM
#: engine against an fp32 trainer: 0.017; W8A8 fp8 rollout 7.6e-3; a bf16 KV cache ~1e-3): a mean
#: |Δ| 25× that is not rounding, whatever the envelope says.
GROSS_MEAN_ABS = 0.5


@dataclass
class Profile:
    steps: list[int]
    mean_abs: float
    first_token: float            # mean |Δ| of the first generated token of each turn (prefill)
    later_tokens: float           # … of the decode tokens
    first_token_share: float      # their share of Σ|Δ|
    early: float                  # mean |Δ| over the first / last quarter of positions in the sample
    late: float
    agree: float | None = None    # mean |Δ| of tokens whose predicting routing agrees in every layer
    flip: float | None = None     # … differs in some layer
    flip_share: float | None = None
    flip_tokens: int = 0
    layer_flip_rate: list[float] = field(default_factory=list)
    first_flip_layer: int | None = None
    experts: list[dict[str, Any]] = field(default_factory=list)   # (layer, expert) concentration, best first
    sign_consistency: float = math.nan   # |mean Δ| / mean |Δ|
    prob_corr: float = math.nan          # Pearson r of Δ with the rollout logprob
    before_first_sync: bool = False      # a flagged step ran the initial weights (policy version 0)
    first_turn: float = math.nan         # mean |Δ| of the tokens generated in each sample's first turn
    later_turns: float = math.nan        # … in the turns after it (the engine was given a context built
    later_first_token: float = math.nan  # by the agent: earlier replies + observations); their first tokens
    rollout_mean: float = math.nan       # mean rollout (engine) logprob of the analysed tokens
    trainer_mean: float = math.nan       # … and the trainer's of the same tokens

    @property
    def gross(self) -> bool:
        """Mean |Δ| beyond what any precision's rounding does (`GROSS_MEAN_ABS`): the engine computed
        another distribution than the trainer's weights give."""
        return math.isfinite(self.mean_abs) and self.mean_abs > GROSS_MEAN_ABS

    def after_turn_boundary(self, floor: float) -> bool:
        """The first turn is inside the envelope and the later turns are not: the engine computed right
        on the context it built itself and went wrong where it was given one assembled for it (an
        engine-side fault — weights, KV cache, prefill, router — hits the first turn as well)."""
        return (math.isfinite(self.first_turn) and math.isfinite(self.later_turns)
                and self.first_turn <= floor < self.later_turns)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def build(ctx: Context, steps: list[int]) -> Profile:
    """The profile of the engine part of Δ over `steps`."""
    floor = ctx.envelope.floor_mean_abs or ctx.floor()
    d = ctx.pooled(steps, ctx.engine_delta)
    ok = np.isfinite(d)
    rp = ctx.pooled(steps, lambda v: v.response_position)
    ap = ctx.pooled(steps, lambda v: v.abs_position)
    raw = ctx.pooled(steps, lambda v: v.delta)
    lp = ctx.pooled(steps, lambda v: v.rollout.astype(np.float64))
    first = ok & (rp == 0)
    later = ok & (rp > 0)
    q = np.quantile(ap[ok], [0.25, 0.75]) if ok.any() else (0, 0)
    total = d[ok].sum()
    p = Profile(steps, mean(d[ok]), mean(d[first]), mean(d[later]),
                float(d[first].sum() / total) if total > 0 else 0.0,
                mean(d[ok & (ap <= q[0])]), mean(d[ok & (ap >= q[1])]))
    p.before_first_sync = any(ctx.views[s].policy_version == 0 for s in steps)
    p.rollout_mean, p.trainer_mean = mean(lp[ok]), mean((lp + raw)[ok])
    turn = ctx.pooled(steps, lambda v: v.turn.astype(np.int64))
    first_turn = ctx.pooled(steps, _first_generated_turn)
    p.first_turn, p.later_turns = mean(d[ok & (turn == first_turn)]), mean(d[ok & (turn > first_turn)])
    p.later_first_token = mean(d[first & (turn > first_turn)])
    if ok.sum() > 2:
        r = raw[ok]
        p.sign_consistency = abs(float(r.mean())) / max(float(np.abs(r).mean()), 1e-30)
        if np.std(r) > 0 and np.std(lp[ok]) > 0:
            p.prob_corr = float(np.corrcoef(r, lp[ok])[0, 1])
    _routing(ctx, steps, d, ok, rp > 0, p, floor)
    return p


def _first_generated_turn(v) -> np.ndarray:
    """Per token: the turn of its sample's first generated token (−1 where the sample has none)."""
    gen = v.generated
    out = np.full(len(v.ids), -1, np.int64)
    for r in range(len(v.offsets) - 1):
        a, b = int(v.offsets[r]), int(v.offsets[r + 1])
        g = np.flatnonzero(gen[a:b])
        if len(g):
            out[a:b] = int(v.turn[a + g[0]])
    return out


def _routing(ctx: Context, steps: list[int], d: np.ndarray, ok: np.ndarray, decode: np.ndarray, p: Profile,
             floor: float) -> None:
    """Routing agreement per layer and the (layer, expert) concentration of |Δ| on agreeing decode
    tokens (a turn's first token is left out: a prefill fault concentrates on the experts it routes to)."""
    views = [ctx.views[s] for s in steps]
    if not views or not all(v.has_routing for v in views):
        return
    flips = np.concatenate([v.predicting_flips() for v in views])        # [T, L]
    experts = np.concatenate([v.predicting_experts() for v in views])    # [T, L, k]
    anyf = flips.any(axis=1)
    p.agree, p.flip = mean(d[ok & ~anyf]), mean(d[ok & anyf])
    p.flip_tokens = int((ok & anyf).sum())
    total = d[ok].sum()
    p.flip_share = float(d[ok & anyf].sum() / total) if total > 0 else 0.0
    p.layer_flip_rate = [float(flips[ok, l].mean()) for l in range(flips.shape[1])]
    p.first_flip_layer = next((l for l, r in enumerate(p.layer_flip_rate) if r > 0), None)
    rows = []
    base = ok & ~anyf & decode
    for layer in range(experts.shape[1]):
        for e in np.unique(experts[base, layer]):
            if e < 0:
                continue
            hit = (experts[:, layer, :] == e).any(axis=1)
            inn, out = base & hit, base & ~hit
            if inn.sum() < 3 or out.sum() < 3:
                continue
            rows.append({"layer": int(layer), "expert": int(e), "tokens": int(inn.sum()),
                         "mean_abs_routed": mean(d[inn]), "mean_abs_other": mean(d[out]),
                         "ratio": ratio(mean(d[inn]), mean(d[out]), floor)})
    p.experts = sorted(rows, key=lambda r: -r["ratio"])[:5]
