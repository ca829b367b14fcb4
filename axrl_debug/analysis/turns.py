"""Per-turn rewards in a trace (`/tokens/turn_reward`, axrl.algo.turn_credit): per step and turn
index, how many samples reached the turn, their mean turn reward, and the mean advantage of the
turn's trained tokens (under `algo.credit: turn` it differs per turn; under `outcome` it does not).

Steps without /tokens/turn_reward (rewards only on last turns, `credit: outcome`) have no rows.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from axrl.trace import TraceReader

COLUMNS = ("/samples/offsets", "/tokens/turn", "/tokens/loss_mask", "/tokens/advantage")


def turn_rows(offsets: np.ndarray, turn: np.ndarray, loss_mask: np.ndarray, advantage: np.ndarray,
              turn_reward: np.ndarray) -> list[dict[str, Any]]:
    """One row per turn index k ≥ 1: samples with a turn k, mean r_k over them, mean advantage of
    the turn-k loss tokens (None when none was trained)."""
    sample = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    rows = []
    for k in range(1, int(turn.max(initial=0)) + 1):
        at = turn == k
        samples = np.unique(sample[at])
        first = np.searchsorted(sample[at], samples)          # a token of turn k in each of those samples
        trained = at & (loss_mask > 0)
        rows.append({"turn": k, "samples": int(samples.size),
                     "reward_mean": float(turn_reward[at][first].mean()) if samples.size else None,
                     "advantage_mean": float(advantage[trained].mean()) if trained.any() else None})
    return rows


def turns_by_step(reader: TraceReader, steps: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """{"step", "turns": turn_rows(...)} for each step that recorded /tokens/turn_reward."""
    out = []
    for sc in reader.iter_columns(COLUMNS, steps, optional=("/tokens/turn_reward",)):
        if "/tokens/turn_reward" not in sc:
            continue
        out.append({"step": sc.step, "turns": turn_rows(
            np.asarray(sc["/samples/offsets"]), np.asarray(sc["/tokens/turn"]), np.asarray(sc["/tokens/loss_mask"]),
            np.asarray(sc["/tokens/advantage"], np.float64), np.asarray(sc["/tokens/turn_reward"], np.float64))})
    return out
