"""Compare two captures point by point against a numerics floor derived from float64 runs.

For a float point and a position (one row), with e/t the engine's and the trainer's values and
e64/t64 the same computations in float64 (`replay.bisect_capture`):

    size  = ‖e − t‖                         (L2 over the row, in float64)
    floor = ‖e − e64‖ + ‖t − t64‖ + 2⁻⁴⁰ ‖t64‖

The floor is each side's own rounding at that point (everything upstream included), measured,
not assumed. When both sides compute the same math, e64 and t64 agree to float64 rounding and the
triangle inequality bounds size by the floor; a row over its floor therefore holds a difference of
math (other weights, another routing, values stored in another precision), not of float rounding.
The last term is the float64 runs' own rounding allowance. Sizes are shown relative to ‖t‖.

`topk_ids` rows differ when the expert sets or their slot order differ; a difference counts as a
divergence only when the float64 runs differ there too (else it is a near-tie flipped by
rounding, counted as the floor). `topk_weights` and `expert_out` compare only rows (slots) whose
expert ids agree on all four runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from replay.bisect_capture import Side

FP64_ALLOWANCE = 2.0 ** -40


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


def compare_float(layer: int, op: str, sides: tuple[Side, Side, Side, Side], mask: torch.Tensor | None = None,
                  per_slot: bool = False) -> PointDiff | None:
    """size vs floor per position of a float point (per (position, slot) with `per_slot`);
    `mask` [positions] or [positions, k]: the rows (slots) to compare."""
    key = (layer, op)
    if any(key not in s.states for s in sides):
        return None
    e, t, e64, t64 = (s.states[key] for s in sides)
    n = min(x.shape[0] for x in (e, t, e64, t64))
    e, t, e64, t64 = e[:n], t[:n], e64[:n], t64[:n]
    if per_slot:  # [n, k, H] → rows (position, slot)
        k = e.shape[1]
        e, t, e64, t64 = (x.reshape(n * k, -1) for x in (e, t, e64, t64))
    E, T, E64, T64 = _rows(e), _rows(t), _rows(e64), _rows(t64)
    ok = torch.isfinite(E).all(-1) & torch.isfinite(T).all(-1) & torch.isfinite(E64).all(-1) & torch.isfinite(T64).all(-1)
    if mask is not None:
        ok &= mask.reshape(-1)[:ok.shape[0]]
    size = (E - T).norm(dim=-1)
    tn = T.norm(dim=-1).clamp_min(1e-300)
    floor = (E - E64).norm(dim=-1) + (T - T64).norm(dim=-1) + FP64_ALLOWANCE * T64.norm(dim=-1)
    over_rows = (ok & (size > floor)).nonzero()[:, 0]
    rows = ok.nonzero()[:, 0]
    out = PointDiff(layer, op, int(rows.numel()))
    if rows.numel() == 0:
        return out
    ratio = torch.where(floor > 0, size / floor.clamp_min(1e-300), torch.where(size > 0, torch.inf, 0.0))
    out.max_ratio = float(ratio[rows].max())
    pick = over_rows if over_rows.numel() else rows
    at = pick[torch.argmax((size / tn)[pick])]
    out.size, out.floor = float(size[at] / tn[at]), float(floor[at] / tn[at])
    if per_slot:
        k = sides[0].states[key].shape[1]
        out.over = sorted({int(r) // k for r in over_rows.tolist()})
        out.detail["slots_over"] = [[int(r) // k, int(r) % k] for r in over_rows.tolist()]
    else:
        out.over = [int(r) for r in over_rows.tolist()]
    return out


def compare_ids(layer: int, sides: tuple[Side, Side, Side, Side]) -> PointDiff | None:
    """`topk_ids`: positions where the expert sets / their slot order differ between the sides."""
    key = (layer, "topk_ids")
    if any(key not in s.states for s in sides):
        return None
    e, t, e64, t64 = (s.states[key].long() for s in sides)
    n = min(x.shape[0] for x in (e, t, e64, t64))
    e, t, e64, t64 = e[:n], t[:n], e64[:n], t64[:n]
    ok = (e >= 0).all(-1) & (t >= 0).all(-1) & (e64 >= 0).all(-1) & (t64 >= 0).all(-1)
    same_order = (e == t).all(-1)
    same_set = (e.sort(-1).values == t.sort(-1).values).all(-1)
    same64 = (e64.sort(-1).values == t64.sort(-1).values).all(-1) & (e64 == t64).all(-1)
    differs = ok & ~same_order
    real = differs & ~same64
    out = PointDiff(layer, "topk_ids", int(ok.sum()))
    out.over = [int(r) for r in real.nonzero()[:, 0].tolist()]
    out.size = float(real.sum())
    out.floor = float((differs & same64).sum())  # near-ties flipped by rounding alone
    out.max_ratio = float("inf") if out.over else 0.0
    out.detail = {"set_differs": [int(r) for r in (ok & ~same_set).nonzero()[:, 0].tolist()],
                  "slot_order_differs": [int(r) for r in (ok & same_set & ~same_order).nonzero()[:, 0].tolist()],
                  "rounding_flips": [int(r) for r in (differs & same64).nonzero()[:, 0].tolist()]}
    return out


def agreeing_slots(layer: int, sides: tuple[Side, Side, Side, Side]) -> torch.Tensor | None:
    """[positions, k]: slots holding the same expert on all four runs (weights / outputs comparable)."""
    key = (layer, "topk_ids")
    if any(key not in s.states for s in sides):
        return None
    ids = [s.states[key].long() for s in sides]
    n = min(x.shape[0] for x in ids)
    ids = [x[:n] for x in ids]
    return (ids[0] == ids[1]) & (ids[0] == ids[2]) & (ids[1] == ids[3]) & (ids[0] >= 0)


def expert_ids_at(side: Side, layer: int, slots: list[list[int]]) -> list[int]:
    """The engine's expert ids at (position, slot) pairs."""
    ids = side.states[(layer, "topk_ids")]
    return sorted({int(ids[p, j]) for p, j in slots})


def vocab_compare(engine: Side, trainer: Side, token_ids: np.ndarray, positions: list[int],
                  top_k: int = 10) -> list[dict[str, Any]]:
    """Full-vocabulary comparison of the two `logprobs` at `positions` (each predicting the next
    token): KL both ways, total variation, top-k overlap, argmax agreement and the sampled token's
    logprob difference (engine − trainer)."""
    e_all, t_all = engine.states.get((-1, "logprobs")), trainer.states.get((-1, "logprobs"))
    if e_all is None or t_all is None:
        return []
    out = []
    for p in positions:
        if p >= min(e_all.shape[0], t_all.shape[0]) or p + 1 >= len(token_ids):
            continue
        e, t = e_all[p].double(), t_all[p].double()
        if not (torch.isfinite(e).all() and torch.isfinite(t).all()):
            continue
        pe, pt = e.exp(), t.exp()
        k = min(top_k, e.shape[0])
        te, tt = set(torch.topk(e, k).indices.tolist()), set(torch.topk(t, k).indices.tolist())
        tok = int(token_ids[p + 1])
        out.append({"position": p, "token": p + 1, "token_id": tok,
                    "kl_engine_trainer": float((pe * (e - t)).sum()), "kl_trainer_engine": float((pt * (t - e)).sum()),
                    "total_variation": float(0.5 * (pe - pt).abs().sum()), "top_k": k,
                    "top_k_overlap": len(te & tt) / k, "argmax_agree": bool(int(e.argmax()) == int(t.argmax())),
                    "sampled_logprob_diff": float(e[tok] - t[tok])})
    return out
