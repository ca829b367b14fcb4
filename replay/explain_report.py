"""What `axrl-debug explain` reports: the per-token explanation (`TokenExplanation`, one
`LayerRow` per component) and the verdicts read from its patch curve — which component the gap
comes from, where patching removes it, and the routing flip that explains it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONCENTRATED", "ExplainResult", "LayerRow", "REMOVED", "TokenExplanation", "named_component",
           "removed_at", "routing_flip"]

REMOVED = 0.1   # a patch "removes" the gap when at most this fraction of it remains
CONCENTRATED = 0.6  # one component is named when its share is at least this part of Σ|shares|


@dataclass
class LayerRow:
    """Divergence at the predicting position in one component (engine vs trainer)."""

    name: str                      # "embedding", "layer 0 attention", "layer 0 moe", "final norm", "lm head"
    rel_diff: float                # ‖engine − trainer‖ / ‖trainer‖ of the component's output there
    max_abs_diff: float
    remaining_gap: float           # gap left after patching the engine's state right after this component
    share: float                   # (remaining before − remaining after) / gap
    router: dict[str, Any] | None = None   # MoE: sets, flip, margins, router-patch gap

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TokenExplanation:
    sample_id: int
    sample_row: int
    token: int                     # index in the sample's stream
    turn: int
    position: int                  # position in its turn's response
    token_id: int
    text: str
    rollout_logprob: float         # recorded (engine)
    old_logprob: float             # recorded (trainer)
    engine_logprob: float          # engine path
    trainer_logprob: float         # trainer path
    gap: float                     # trainer − engine (the paths)
    engine_reproduces_rollout: bool
    trainer_reproduces_old: bool
    rows: list[LayerRow]
    r3_gap: float                  # the gap with R3 (the engine's routing in every MoE layer)
    named: str                     # the component with the largest share, or "diffuse: …"
    token_logit: list[float]       # the token's logit at the predicting position: [engine, trainer]
    logit_ulp: float               # the spacing of the logits' dtype at that magnitude
    removed_at: str | None         # first component after which the gap stays below REMOVED
    flip: str | None               # a routing flip that explains the gap, or None
    hidden_norms: dict[str, list[float]] = field(default_factory=dict)  # per point: [engine, trainer] norms

    def headline(self) -> str:
        return (f"sample {self.sample_id}, token {self.token} (turn {self.turn}, response position {self.position}) "
                f"{self.text!r}: rollout {self.rollout_logprob:.6g}, trainer {self.old_logprob:.6g}, "
                f"Δ {self.old_logprob - self.rollout_logprob:+.4g}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d


@dataclass
class ExplainResult:
    run: Path
    step: int
    tokens: list[TokenExplanation]
    fidelity: dict[str, Any]
    notes: list[str]
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"run": str(self.run), "step": self.step, "tokens": [t.to_dict() for t in self.tokens],
                "fidelity": self.fidelity, "notes": self.notes, "timings": self.timings}


# ------------------------------------------------------------------------------------------ the method

def named_component(rows: list[LayerRow], g0: float) -> str:
    """The component whose patch removes the gap; "diffuse" when the patch curve goes back and forth
    (rounding noise that any component can tip, e.g. one bf16 ulp of a logit)."""
    if g0 == 0:
        return "none (no gap)"
    total = sum(abs(r.share) for r in rows)
    best = max(rows, key=lambda r: r.share)
    if best.share > 0 and best.share >= CONCENTRATED * total:
        return best.name
    top = sorted(rows, key=lambda r: -abs(r.share))[:3]
    return "diffuse: " + ", ".join(f"{r.name} {r.share:+.0%}" for r in top)


def removed_at(rows: list[LayerRow], g0: float) -> str | None:
    if g0 == 0:
        return None
    for i, row in enumerate(rows):
        if all(abs(r.remaining_gap) <= REMOVED * abs(g0) for r in rows[i:]):
            return row.name
    return None


def routing_flip(rows: list[LayerRow], g0: float, r3_gap: float) -> str | None:
    """The routing flip that explains the gap: flipped positions in a layer where forcing the
    engine's experts (R3 on that layer alone) removes at least half of the gap (the strongest)."""
    if g0 == 0:
        return None
    best = None
    for row in rows:
        rt = row.router
        if rt is None or not rt["flipped_positions"]:
            continue
        removed = 1 - abs(rt["r3_layer_gap"]) / abs(g0)
        if removed >= 0.5 and (best is None or removed > best[0]):
            best = (removed, row.name, rt)
    if best is None:
        return None
    removed, name, rt = best
    where = "at the predicting position" if rt["flip"] else f"at {len(rt['flipped_positions'])} earlier position(s)"
    return (f"{name.replace(' moe', '')} routing flip {where} (engine {rt['engine_experts']} vs trainer "
            f"{rt['trainer_experts']}, trainer margin {rt['trainer_margin']:.3g}): the engine's experts in that layer "
            f"remove {removed:.0%} of the gap ({rt['r3_layer_gap']:+.3g} left); with R3 this token's gap would be "
            f"{r3_gap:+.3g} (now {g0:+.3g})")
