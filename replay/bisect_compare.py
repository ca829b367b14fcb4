"""Compare two captures point by point against a numerics floor derived from float64 runs.

The captures (`replay.bisect_capture`): e (the engine as it ran), t (the trainer as it ran), ē
(the engine's fp32 computation of the sample alone without activation-dependent rounding: K/V
and activations unquantised; e itself when the run has none), and e64 / t64 (the same math as ē
and t in float64). For a float point, per position (row):

    size  = ‖e − t‖ / ‖t64‖                     (L2 over the row, in float64)
    noise = (‖ē − e64‖ + ‖t − t64‖) / ‖t64‖

and the op's floor is the largest noise over the sample's positions, plus the float64 runs' own
rounding allowance (2⁻⁴⁰). The noise is each side's own rounding at that point (everything
upstream included), measured, not assumed: when both sides compute the same math, e64 and t64
agree to float64 rounding and the triangle inequality bounds ‖e − t‖ by it. A position over the
floor therefore holds a difference of math: other weights, another routing, or values stored in
another precision (a quantised KV cache or fp8 activations are left out of ē and e64 on purpose,
so that storage precision shows as a divergence instead of raising the floor).

`topk_ids` rows differ when the expert sets or their slot order differ; a difference counts as a
divergence only where neither side's float64 run picks other experts than its fp32 run (else it
is a near-tie flipped by rounding, counted as the floor). `topk_weights` and `expert_out` compare
only rows (slots) whose expert ids agree on all runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replay.bisect_capture import Side

FP64_ALLOWANCE = 2.0 ** -40


@dataclass
class Sides:
    """The five captures compared (see the module doc)."""

    engine: Side
    trainer: Side
    engine_ref: Side       # ē: the engine's fp32 math without activation-dependent rounding
    engine64: Side
    trainer64: Side

    def __post_init__(self) -> None:
        # The trainer computed each position once: its rows repeated at the engine's rows.
        pos = self.engine.positions
        if pos is not None:
            for side in (self.trainer, self.trainer64):
                if side.positions is None:
                    side.states, side.positions = side.rows_of(pos), pos

    def position(self, rows: list[int]) -> list[int]:
        """Sorted distinct token positions of engine rows."""
        pos = self.engine.positions
        return sorted({int(pos[r]) if pos is not None else r for r in rows})

    def turns(self, rows: list[int]) -> list[int]:
        """Sorted distinct turns of the requests of engine rows."""
        t = self.engine.turn_of_row
        return sorted({t[r] for r in rows}) if t else []

    @property
    def all(self) -> tuple[Side, Side, Side, Side, Side]:
        return (self.engine, self.trainer, self.engine_ref, self.engine64, self.trainer64)


@dataclass
class PointDiff:
    """One (layer, point)'s comparison over the positions both sides computed."""

    layer: int
    op: str
    rows: int                                   # positions compared
    over: list[int] = field(default_factory=list)  # positions whose difference exceeds the floor
    size: float = 0.0                           # the largest relative difference ‖e − t‖ / ‖t‖ over `over` (else all)
    floor: float = 0.0                          # the relative floor at that position
    max_ratio: float = 0.0                      # max over positions of size / floor
    experts: list[int] = field(default_factory=list)  # expert_out: experts at the slots over the floor
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return bool(self.over)

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "op": self.op, "rows": self.rows, "over": self.over, "size": self.size,
                "floor": self.floor, "max_ratio": self.max_ratio, "experts": self.experts, **self.detail}


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.double().reshape(x.shape[0], -1)


def _finite(*xs: torch.Tensor) -> torch.Tensor:
    ok = torch.ones(xs[0].shape[0], dtype=torch.bool)
    for x in xs:
        ok &= torch.isfinite(x).all(-1)
    return ok


def compare_float(layer: int, op: str, sides: Sides, mask: torch.Tensor | None = None,
                  per_slot: bool = False) -> PointDiff | None:
    """size per position of a float point vs the op's floor (per (position, slot) with
    `per_slot`); `mask` [positions] or [positions, k]: the rows (slots) to compare."""
    key = (layer, op)
    if any(key not in s.states for s in sides.all):
        return None
    xs = [s.states[key] for s in sides.all]
    n = min(x.shape[0] for x in xs)
    xs = [x[:n] for x in xs]
    if per_slot:  # [n, k, H] → rows (position, slot)
        xs = [x.reshape(n * x.shape[1], -1) for x in xs]
    E, T, B, E64, T64 = (_rows(x) for x in xs)
    if mask is not None and mask.dim() == 2 and not per_slot:
        mask = mask.all(-1)  # a position's weights compare when all its slots hold the same experts
    keep = mask[:n].reshape(-1) if mask is not None else torch.ones(E.shape[0], dtype=torch.bool)
    ok = _finite(E, T, T64) & keep                 # rows compared
    ref = _finite(B, E64, T, T64) & keep           # rows the noise is measured on
    tn = T64.norm(dim=-1).clamp_min(1e-300)
    size = (E - T).norm(dim=-1) / tn
    noise = ((B - E64).norm(dim=-1) + (T - T64).norm(dim=-1)) / tn
    floor = (float(noise[ref].max()) if bool(ref.any()) else 0.0) + FP64_ALLOWANCE
    over_rows = (ok & (size > floor)).nonzero()[:, 0]
    rows = ok.nonzero()[:, 0]
    out = PointDiff(layer, op, int(rows.numel()), floor=floor)
    if rows.numel() == 0:
        return out
    out.size = float(size[rows].max())
    out.max_ratio = out.size / floor
    k = sides.engine.states[key].shape[1] if per_slot else 1
    rows_over = sorted({int(r) // k for r in over_rows.tolist()})
    out.over = sides.position(rows_over)
    if rows_over:
        out.detail["turns"] = sides.turns(rows_over)
    if per_slot:  # (position, slot, expert) of each slot over the floor
        ids, pos = sides.engine.states[(layer, "topk_ids")], sides.engine.positions
        slots = [(int(r) // k, int(r) % k) for r in over_rows.tolist()]
        out.detail["slots_over"] = sorted({(int(pos[r]) if pos is not None else r, j, int(ids[r, j])) for r, j in slots})
        out.experts = sorted({e for _, _, e in out.detail["slots_over"]})
    return out


def compare_ids(layer: int, sides: Sides) -> PointDiff | None:
    """`topk_ids`: positions where the expert sets / their slot order differ between the sides."""
    key = (layer, "topk_ids")
    if any(key not in s.states for s in sides.all):
        return None
    xs = [s.states[key].long() for s in sides.all]
    n = min(x.shape[0] for x in xs)
    e, t, b, e64, t64 = (x[:n] for x in xs)
    ok = (e >= 0).all(-1) & (t >= 0).all(-1) & (t64 >= 0).all(-1)
    same_order = (e == t).all(-1)
    same_set = (e.sort(-1).values == t.sort(-1).values).all(-1)
    # a near-tie: rounding alone moves either side's choice (fp32 vs its float64 run) there
    tie = ~(t == t64).all(-1) | (((b >= 0).all(-1) & (e64 >= 0).all(-1)) & ~(b == e64).all(-1))
    differs = ok & ~same_order
    real = differs & ~tie
    out = PointDiff(layer, "topk_ids", int(ok.sum()))
    out.over = sides.position(real.nonzero()[:, 0].tolist())
    out.size = float(real.sum())
    out.floor = float((differs & tie).sum())  # near-ties flipped by rounding alone
    out.max_ratio = float("inf") if out.over else 0.0
    out.detail = {"set_differs": sides.position((ok & ~same_set).nonzero()[:, 0].tolist()),
                  "slot_order_differs": sides.position((ok & same_set & ~same_order).nonzero()[:, 0].tolist()),
                  "rounding_flips": sides.position((differs & tie).nonzero()[:, 0].tolist())}
    return out


def agreeing_slots(layer: int, sides: Sides) -> torch.Tensor | None:
    """[positions, k]: slots holding the same expert in e and t, where neither side's float64 run
    picked another one (weights / outputs comparable); positions ē did not compute count as agreeing
    there."""
    key = (layer, "topk_ids")
    if any(key not in s.states for s in sides.all):
        return None
    xs = [s.states[key].long() for s in sides.all]
    n = min(x.shape[0] for x in xs)
    e, t, b, e64, t64 = (x[:n] for x in xs)
    return (e == t) & (t == t64) & ((b == e64) | (b < 0) | (e64 < 0)) & (e >= 0)


def vocab_compare(sides: Sides, token_ids: np.ndarray, top_k: int = 10) -> list[dict[str, Any]]:
    """Full-vocabulary comparison of the engine's and the trainer's `logprobs` at every position
    the engine sampled from (each predicting the next token): KL both ways, total variation, top-k
    overlap, argmax agreement and the sampled token's logprob difference (engine − trainer). Both
    are renormalised in float64 first, so the KLs are ≥ 0."""
    e_all, t_all = sides.engine.states.get((-1, "logprobs")), sides.trainer.states.get((-1, "logprobs"))
    if e_all is None or t_all is None:
        return []
    pos = sides.engine.positions if sides.engine.positions is not None else torch.arange(e_all.shape[0])
    out = []
    for r in range(e_all.shape[0]):
        p = int(pos[r])
        e, t = e_all[r].double(), t_all[r].double()
        if p + 1 >= len(token_ids) or not (torch.isfinite(e).all() and torch.isfinite(t).all()):
            continue
        e, t = e - torch.logsumexp(e, 0), t - torch.logsumexp(t, 0)
        pe, pt = e.exp(), t.exp()
        k = min(top_k, e.shape[0])
        te, tt = set(torch.topk(e, k).indices.tolist()), set(torch.topk(t, k).indices.tolist())
        tok = int(token_ids[p + 1])
        out.append({"position": p, "token": p + 1, "token_id": tok, "turn": sides.turns([r])[0] if sides.engine.turn_of_row else 0,
                    "kl_engine_trainer": float((pe * (e - t)).sum()), "kl_trainer_engine": float((pt * (t - e)).sum()),
                    "total_variation": float(0.5 * (pe - pt).abs().sum()), "top_k": k,
                    "top_k_overlap": len(te & tt) / k, "argmax_agree": bool(int(e.argmax()) == int(t.argmax())),
                    "sampled_logprob_diff": float(e_all[r][tok].double() - t_all[r][tok].double())})
    return out
