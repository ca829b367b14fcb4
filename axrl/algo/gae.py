"""PPO with a learned critic: per-token rewards, GAE advantages and returns, and the value loss.

`algo.advantage: gae`. A trajectory's *trained* tokens (loss mask 1: the assistant's sampled
tokens) are the steps of the MDP; prompt, environment and tool tokens (loss mask 0) are not
steps — γ and λ step only over trained tokens, as verl's multi-turn GAE does (the env's tokens
are not the policy's actions, and a value between them would be a guess about text the policy
does not choose). Index the trained tokens of one trajectory j = 0..n−1 (in order), with value
V_j = critic(prefix before token j) and reward r_j:

    outcome credit:  r_j = R at the last trained token (R = task reward + overlong penalty), else 0
    turn credit:     r_j = r̃_k at the last trained token of turn k (r̃: axrl.algo.turn_credit), else 0

The discount between step j and j+1 is per *turn*, as `algo.gamma` means for turn credit:

    g_j = γ  if token j+1 starts a new turn (turn(j+1) ≠ turn(j)),   1 within a turn

so a single-turn episode is undiscounted whatever γ, and γ discounts the later turns' rewards
exactly as turn credit's G_k does. With V_n = 0 after the last step (the episode ends):

    δ_j = r_j + g_j · V_{j+1} − V_j
    A_j = δ_j + g_j · λ · A_{j+1}          (A_n = 0;  λ = `algo.lam`)
    R_j = A_j + V_j                        (the critic's target: the λ-return)

The policy trains on the advantages whitened over the batch's trained tokens,
Â = (A − mean) / sqrt(var + 1e-8) (as verl does for GAE); the returns are not whitened.
With γ = λ = 1 and outcome credit, R_j = R for every token and A_j = R − V_j.

The critic regresses its values on these returns with PPO's clipped value loss
(`axrl.train.value_loss`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from axrl.algo.turn_credit import effective_turn_rewards

__all__ = ["token_rewards", "turn_discounts", "gae", "whiten"]


def _sample_slices(offsets: torch.Tensor | np.ndarray) -> list[tuple[int, int]]:
    off = np.asarray(torch.as_tensor(offsets), np.int64)
    return [(int(a), int(b)) for a, b in zip(off[:-1], off[1:])]


def token_rewards(rewards: np.ndarray, offsets: torch.Tensor | np.ndarray, loss_mask: torch.Tensor | np.ndarray,
                  turn: np.ndarray, *, credit: str = "outcome",
                  turn_rewards: Sequence[Sequence[float]] | None = None,
                  num_turns: Sequence[int] | None = None) -> np.ndarray:
    """float64 [T]: each trajectory's reward placed on its trained tokens (module docstring).

    `rewards` [N] are the (shaped) total rewards. Under turn credit, a turn without trained tokens
    (its reward has nowhere to go) credits the last trained token before it, or the first after.
    """
    mask = np.asarray(torch.as_tensor(loss_mask)).reshape(-1) > 0
    turn = np.asarray(turn, np.int64).reshape(-1)
    out = np.zeros(len(mask), np.float64)
    for i, (a, b) in enumerate(_sample_slices(offsets)):
        idx = a + np.flatnonzero(mask[a:b])
        if idx.size == 0:
            continue
        if credit != "turn":
            out[idx[-1]] += float(rewards[i])
            continue
        assert turn_rewards is not None and num_turns is not None
        k_total = int(num_turns[i])
        for k, r in enumerate(effective_turn_rewards(turn_rewards[i], float(rewards[i]), k_total), start=1):
            upto = idx[turn[idx] <= k]
            out[upto[-1] if upto.size else idx[0]] += r
    return out


def turn_discounts(turn: np.ndarray, idx: np.ndarray, gamma: float) -> np.ndarray:
    """float64 [n]: g_j for the trained tokens `idx` of one trajectory (γ where token j+1 starts a
    new turn, else 1; the last entry is unused)."""
    t = np.asarray(turn, np.int64)[idx]
    g = np.ones(len(idx), np.float64)
    if len(idx) > 1:
        g[:-1] = np.where(t[1:] != t[:-1], gamma, 1.0)
    return g


def gae(rewards: np.ndarray, values: torch.Tensor | np.ndarray, offsets: torch.Tensor | np.ndarray,
        loss_mask: torch.Tensor | np.ndarray, turn: np.ndarray, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) float32 [T] by the backward GAE recursion over each trajectory's
    trained tokens (module docstring), computed in float64; 0 off the loss mask."""
    v = np.asarray(torch.as_tensor(values), np.float64).reshape(-1)
    mask = np.asarray(torch.as_tensor(loss_mask)).reshape(-1) > 0
    adv = np.zeros(len(mask), np.float64)
    ret = np.zeros(len(mask), np.float64)
    for a, b in _sample_slices(offsets):
        idx = a + np.flatnonzero(mask[a:b])
        g = turn_discounts(turn, idx, gamma)
        running, next_value = 0.0, 0.0
        for j in range(len(idx) - 1, -1, -1):
            t = idx[j]
            step = g[j] if j + 1 < len(idx) else 0.0   # nothing after the last step
            delta = rewards[t] + step * next_value - v[t]
            running = delta + step * lam * running
            adv[t], ret[t] = running, running + v[t]
            next_value = v[t]
    return torch.from_numpy(adv).float(), torch.from_numpy(ret).float()


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """float32 [T]: (A − mean) / sqrt(var + eps) over the trained tokens (population var), 0 elsewhere."""
    m = torch.as_tensor(loss_mask).reshape(-1) > 0
    if not bool(m.any()):
        return torch.zeros_like(advantages)
    a = advantages.double()[m]
    out = torch.zeros(advantages.shape, dtype=torch.float64)
    out[m] = (a - a.mean()) / torch.sqrt(a.var(unbiased=False) + eps)
    return out.float()
