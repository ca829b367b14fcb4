"""Turn-level credit (`algo.credit: turn`): per-turn returns → per-turn, per-token advantages.

An episode of K turns (turn k = the k-th assistant reply, k = 1..K; turn 0 is the prompt) may be
rewarded per turn: r_1 … r_K (the env's `StepOutcome.reward`, or a black-box agent's
`POST /sessions/{id}/reward` with "turn"). The sample's scalar reward R stays the total that
`credit: outcome` trains on; whatever R holds beyond the per-turn rewards (a final or verifier
reward, the overlong penalty) is credited to the last turn:

    r̃_k = r_k                       k < K
    r̃_K = r_K + (R − Σ_k r_k)      (R includes the overlong penalty when it is on)

Returns are discounted over turns with γ = `algo.gamma` (per turn, default 1):

    G_k = Σ_{k' ≥ k} γ^(k'−k) · r̃_k'

Each (sample, turn) pair is a *unit*. Units are normalised within (group, turn index): for turn
index k, the units of the group's samples that reached turn k are compared with each other, by the
configured estimator (`grpo`: (G − mean) / (std + eps); `dr_grpo`: G − mean; see
`axrl.algo.advantages`), then `advantage_clip` and `advantage_balance` apply to units (balance
weighs a unit by its generated tokens). A unit alone at its turn index (no other sample of its group
got that far) has no baseline: advantage 0. Every generated token of turn k gets A_k:

    A_token = A_(sample, turn(token)) · loss_mask(token)

With γ = 1 and rewards only at the end, G_k = R for every k, so every turn gets the outcome
advantage of the samples that reached it. The sample-level advantage reported under turn credit
(`/samples/advantage`) is that of its first turn (0 for a sample without turns).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

if TYPE_CHECKING:  # the processor imports this module; avoid the cycle at run time
    from axrl.algo.processor import AdvantageSettings

CREDITS = ("outcome", "turn")

__all__ = ["CREDITS", "effective_turn_rewards", "turn_returns", "turn_credit_advantages",
           "turn_reward_column", "turn_rewards_from_column", "records_turn_rewards"]


def effective_turn_rewards(turn_rewards: Sequence[float], reward: float, num_turns: int) -> np.ndarray:
    """float64 [K]: r̃ — the per-turn rewards padded / cut to K = num_turns, with the remainder of
    the total reward R over their sum credited to the last turn (module docstring)."""
    r = np.zeros(num_turns, np.float64)
    given = np.asarray(turn_rewards, np.float64)[:num_turns]
    r[: len(given)] = given
    if num_turns:
        r[-1] += float(reward) - float(given.sum())
    return r


def turn_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """float64 [K]: G_k = Σ_{k'≥k} γ^(k'−k) r_k', by the backward recursion G_k = r_k + γ G_{k+1}."""
    out = np.zeros(len(rewards), np.float64)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = float(rewards[k]) + gamma * running
        out[k] = running
    return out


def _units(shaped: np.ndarray, turn_rewards: Sequence[Sequence[float]], num_turns: np.ndarray,
           gamma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample row, turn index 1..K, return G) of every unit, sample after sample, turn after turn."""
    rows, turns, returns = [], [], []
    for i, k in enumerate(np.asarray(num_turns, np.int64).tolist()):
        g = turn_returns(effective_turn_rewards(turn_rewards[i], shaped[i], k), gamma)
        rows.extend([i] * k)
        turns.extend(range(1, k + 1))
        returns.extend(g.tolist())
    return (np.asarray(rows, np.int64), np.asarray(turns, np.int64), np.asarray(returns, np.float64))


def _dense_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int64 dense label per (a, b) pair: the (group, turn index) a unit is normalised within."""
    if a.size == 0:
        return np.zeros(0, np.int64)
    _, inverse = np.unique(np.stack([a, b], axis=1), axis=0, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def turn_credit_advantages(settings: "AdvantageSettings", rewards: np.ndarray,
                           turn_rewards: Sequence[Sequence[float]], num_turns: np.ndarray,
                           group_ids: np.ndarray, ok: np.ndarray, offsets: torch.Tensor,
                           loss_mask: torch.Tensor, turn: torch.Tensor | np.ndarray
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample advantages float32 [N], token advantages float32 [T]) under turn credit.

    `rewards` [N] are the samples' total task rewards, `turn_rewards[i]` sample i's per-turn
    rewards (turn 1 first), `num_turns` [N] its turn count K_i, `turn` [T] each token's turn index.
    The estimator / clip / balance of `settings` are applied to units by
    `AdvantageSettings.sample_advantages` itself (one implementation of the pipeline).
    """
    offsets_np = torch.as_tensor(offsets).numpy().astype(np.int64)
    mask = torch.as_tensor(loss_mask).reshape(-1).numpy()
    turn_np = np.asarray(turn, np.int64).reshape(-1)
    shaped = np.asarray(rewards, np.float64)
    sample_of_token = np.repeat(np.arange(len(shaped)), np.diff(offsets_np))
    generated = np.bincount(sample_of_token, weights=mask.astype(np.float64), minlength=len(shaped))
    pen = settings.penalties(generated * np.asarray(ok, bool))
    if pen is not None:
        shaped = shaped + pen
    rows, turns, returns = _units(shaped, turn_rewards, num_turns, settings.gamma)
    start = np.concatenate([[0], np.cumsum(np.asarray(num_turns, np.int64))])   # first unit of each sample
    unit_of_token = np.where(turn_np >= 1, start[sample_of_token] + turn_np - 1, -1)
    trained = (mask > 0) & (turn_np >= 1)
    unit_tokens = np.bincount(unit_of_token[trained], weights=mask[trained].astype(np.float64),
                              minlength=len(rows)) if len(rows) else np.zeros(0)
    unit_ok = np.asarray(ok, bool)[rows] if len(rows) else np.zeros(0, bool)
    per_unit = dataclasses.replace(settings, overlong=None).sample_advantages(
        returns, _dense_pairs(np.asarray(group_ids, np.int64)[rows], turns), unit_ok, unit_tokens)
    tokens = torch.zeros(len(turn_np), dtype=torch.float32)
    tokens[torch.from_numpy(trained)] = per_unit[torch.from_numpy(unit_of_token[trained])]
    first = torch.zeros(len(shaped), dtype=torch.float32)
    has_turns = np.asarray(num_turns, np.int64) > 0
    first[torch.from_numpy(has_turns)] = per_unit[torch.from_numpy(start[:-1][has_turns])]
    return first, tokens


def turn_reward_column(turn_rewards: Sequence[float], turn: np.ndarray) -> np.ndarray:
    """float64 [T] of one sample: the reward of each token's turn (0 on turn-0 prompt tokens and on
    turns without a recorded reward) — the trace's /tokens/turn_reward."""
    r = np.concatenate([[0.0], np.asarray(turn_rewards, np.float64)])
    t = np.asarray(turn, np.int64)
    return np.where(t < len(r), r[np.clip(t, 0, len(r) - 1)], 0.0)


def turn_rewards_from_column(column: np.ndarray, turn: np.ndarray, num_turns: int) -> list[float]:
    """Inverse of `turn_reward_column` for one sample: r_1 … r_K (0 for a turn with no tokens,
    whose reward the column cannot hold)."""
    out = [0.0] * num_turns
    t = np.asarray(turn, np.int64)
    for k in range(1, num_turns + 1):
        hit = np.flatnonzero(t == k)
        if hit.size:
            out[k - 1] = float(column[hit[0]])
    return out


def records_turn_rewards(credit: str, turn_rewards: Sequence[Sequence[float]]) -> bool:
    """Whether a step's trace gets /tokens/turn_reward: under turn credit, or when some sample was
    rewarded before its last turn (otherwise the column adds nothing to /samples/reward: an absent
    column reads as every reward on the last turn, so default traces do not change)."""
    return credit == "turn" or any(any(r != 0.0 for r in list(rs)[:-1]) for rs in turn_rewards)
