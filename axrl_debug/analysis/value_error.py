"""The PPO critic's value error in a trace (`/tokens/value`, `/tokens/return`; algo.advantage: gae):
e = V − R on each trained token, where V is the critic's value before the step's updates and R
GAE's return (its target). Broken down by turn index and by position (the token's index among
its sample's trained tokens, in power-of-two bins), pooled over the chosen steps and per step.

A critic that is learning shows |e| falling over the steps; a bias (mean e far from 0) by turn or
by position says where it has not: e.g. late turns, whose returns depend on more of the episode.
Steps without /tokens/value (a critic-free run) have no rows.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from axrl.trace import TraceReader

COLUMNS = ("/samples/offsets", "/tokens/turn", "/tokens/loss_mask")
VALUE_COLUMNS = ("/tokens/value", "/tokens/return")


def position_bin(j: np.ndarray) -> np.ndarray:
    """int64: the power-of-two bin of trained-token index j (0: j=0, 1: 1, 2: 2–3, 3: 4–7, …)."""
    j = np.asarray(j, np.int64)
    return np.where(j == 0, 0, np.floor(np.log2(np.maximum(j, 1))).astype(np.int64) + 1)


def bin_label(b: int) -> str:
    """The trained-token indices of position bin `b`, e.g. "4–7"."""
    if b <= 1:
        return str(b)
    return f"{2 ** (b - 1)}–{2 ** b - 1}"


def trained_positions(offsets: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """int64 [T]: each token's index among its sample's trained tokens (−1 off the loss mask)."""
    m = np.asarray(loss_mask) > 0
    running = np.cumsum(m) - 1
    starts = np.asarray(offsets[:-1], np.int64)
    before = np.concatenate([[0], np.cumsum(m)])[starts]     # trained tokens before each sample
    sample = np.repeat(np.arange(len(starts)), np.diff(offsets))
    return np.where(m, running - before[sample], -1)


def _stats(e: np.ndarray) -> dict[str, Any]:
    return {"tokens": int(e.size), "mean": float(e.mean()) if e.size else None,
            "mean_abs": float(np.abs(e).mean()) if e.size else None,
            "rmse": float(np.sqrt((e ** 2).mean())) if e.size else None}


def breakdown(turn: np.ndarray, position: np.ndarray, error: np.ndarray) -> dict[str, list[dict[str, Any]]]:
    """{"by_turn": [{turn, tokens, mean, mean_abs, rmse}], "by_position": [{bin, positions, …}]}
    of the trained tokens' errors `error` (with their turn index and trained-token position)."""
    by_turn = [{"turn": int(k), **_stats(error[turn == k])} for k in np.unique(turn)]
    bins = position_bin(position)
    by_pos = [{"bin": int(b), "positions": bin_label(int(b)), **_stats(error[bins == b])} for b in np.unique(bins)]
    return {"by_turn": by_turn, "by_position": by_pos}


def value_errors(reader: TraceReader, steps: Iterable[int] | None = None) -> dict[str, Any] | None:
    """{"steps": [{"step", **_stats, **breakdown}], "all": breakdown pooled over the steps} for the
    steps that recorded /tokens/value; None when none did."""
    per_step, turns, positions, errors = [], [], [], []
    for sc in reader.iter_columns(COLUMNS, steps, optional=VALUE_COLUMNS):
        if not all(c in sc for c in VALUE_COLUMNS):
            continue
        mask = np.asarray(sc["/tokens/loss_mask"]) > 0
        e = (np.asarray(sc["/tokens/value"], np.float64) - np.asarray(sc["/tokens/return"], np.float64))[mask]
        turn = np.asarray(sc["/tokens/turn"], np.int64)[mask]
        pos = trained_positions(np.asarray(sc["/samples/offsets"], np.int64), mask)[mask]
        per_step.append({"step": sc.step, **_stats(e), **breakdown(turn, pos, e)})
        turns.append(turn)
        positions.append(pos)
        errors.append(e)
    if not per_step:
        return None
    return {"steps": per_step, "all": breakdown(np.concatenate(turns), np.concatenate(positions),
                                                np.concatenate(errors))}
