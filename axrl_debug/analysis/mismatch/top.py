"""The worst tokens (largest |Δ|): their record and their selection inside a block."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from axrl.trace.quantities import split_deltas

from .keys import _segment_positions
from .scratch import _Scratch

# Filled only from traces with /tokens/behaviour_train_logprob; left out of ``as_dict`` otherwise.
_SPLIT_FIELDS = ("engine_delta", "staleness_delta")


@dataclass
class TopToken:
    """One of the worst tokens (largest |Δ|); ``context`` is filled in by ``attach_context``."""

    step: int
    token: int          # index in the step's /tokens arrays
    sample: int         # row in /samples
    delta: float
    rollout_logprob: float
    old_logprob: float
    position: int | None = None
    turn: int | None = None
    policy_version: int | None = None
    lag: int | None = None
    entropy: float | None = None
    routing: str | None = None
    token_id: int | None = None
    text: str | None = None
    context: str | None = None
    sample_id: int | None = None
    engine_delta: float | None = None       # behaviour_train − rollout (NaN: not computed)
    staleness_delta: float | None = None    # old − behaviour_train

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for name in _SPLIT_FIELDS:
            if d[name] is None:
                del d[name]
        d["abs_delta"] = abs(self.delta)
        d["rollout_prob"] = math.exp(self.rollout_logprob)
        d["trainer_prob"] = math.exp(self.old_logprob)
        return d


def _top_positions(ad: np.ndarray, k: int, threshold: float | None, ws: _Scratch | None = None) -> np.ndarray:
    """Positions (ascending) of the ≤ k largest values of ``ad`` that are ≥ ``threshold``; among
    equal values the first positions win, so the overall top-K is (|Δ| desc, step, token)."""
    if threshold is None:
        cand, vals = None, ad
    else:
        cand = np.flatnonzero(np.greater_equal(ad, threshold, out=(ws or _Scratch())("flag", ad.size, bool)))
        vals = ad[cand]
    if vals.size > k:
        kth = np.partition(vals, vals.size - k)[vals.size - k]
        above = np.flatnonzero(vals > kth)
        ties = np.flatnonzero(vals == kth)[: k - above.size]
        pick = np.sort(np.concatenate([above, ties]))
    else:
        pick = np.arange(vals.size)
    return pick if cand is None else cand[pick]


def token_position(i: int, s0: int, loss_mask: np.ndarray, turn: np.ndarray) -> int:
    """``_segment_positions`` of the one token ``i`` of the sample starting at ``s0`` (for the few
    worst tokens of the compiled path)."""
    starts = np.zeros(i + 1 - s0, dtype=bool)
    starts[0] = True
    return int(_segment_positions(loss_mask[s0:i + 1] != 0, starts, turn[s0:i + 1])[-1])


def split_fields(rollout_lp: Any, old_lp: Any, behaviour_lp: Any) -> dict[str, float]:
    """The ``engine_delta`` / ``staleness_delta`` fields of one worst token."""
    engine, stale = split_deltas(rollout_lp, old_lp, behaviour_lp)
    return {"engine_delta": float(engine), "staleness_delta": float(stale)}


def collapse_identical(top: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The worst tokens with identical rows collapsed: the same token at the same position of
    identical samples (a group's samples often repeat one completion) is one row with
    ``identical`` = how many and ``sample_ids`` = whose; the first ``k`` distinct rows, in order.
    Identical = same step, token id, decoded context, position, turn and Δ."""
    rows: dict[tuple, dict[str, Any]] = {}
    for t in top:
        key = (t["step"], t.get("token_id"), t.get("context"), t.get("position"), t.get("turn"), t["delta"])
        if key in rows:
            rows[key]["identical"] += 1
            rows[key]["sample_ids"].append(t.get("sample_id"))
        else:
            rows[key] = {**t, "identical": 1, "sample_ids": [t.get("sample_id")]}
    return list(rows.values())[:k]
