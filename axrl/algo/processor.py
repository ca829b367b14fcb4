"""AlgorithmProcessor: complete groups of trajectories → rewards → advantages → a packed batch.

The reward-to-advantage pipeline (`AdvantageSettings.sample_advantages`) is shared with replay,
which recomputes advantages from the recorded rewards for what-ifs:

    reward  = task reward + overlong penalty (DAPO soft punishment, optional)
    A_i     = estimator(reward, group)                  grpo | dr_grpo | reinforce
    A_i     = clip(A_i, −c, c)                          algo.advantage_clip (optional)
    A_i     = A_i · (M₊ / M₋) for A_i < 0               algo.advantage_balance: M± = Σ_i |A_i|·n_i over
                                                        positive / negative samples (n_i loss tokens)

With `algo.credit: turn` the same pipeline runs on (sample, turn) units of per-turn returns instead
of samples (axrl.algo.turn_credit); `credit: outcome` (default) is the above, unchanged.
With `algo.advantage: gae` (PPO with a critic) the processor only places the rewards on tokens;
the advantages come from the critic's values once the trainer has them (`with_gae`, axrl.algo.gae).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from axrl.algo.advantages import compute_advantages, token_advantages
from axrl.algo.gae import gae, token_rewards, whiten
from axrl.algo.turn_credit import records_turn_rewards, turn_credit_advantages, turn_reward_column
from axrl.core.trajectory import Trajectory
from axrl.train.protocol import PackedBatch

__all__ = ["AdvantageSettings", "AlgorithmProcessor", "ProcessedBatch", "informative_groups", "overlong_penalty",
           "update_splits", "with_gae", "gae_advantages", "gae_token_rewards"]


def update_splits(group_ids: Sequence[int] | np.ndarray, updates: int) -> list[list[int]]:
    """Sample rows of each optimizer update: `updates` contiguous, near-equal chunks of whole
    groups (consecutive rows with one group id), in order — the fixed order replay relies on."""
    ids = list(np.asarray(group_ids).tolist())
    groups: list[list[int]] = []
    for i, g in enumerate(ids):
        if groups and ids[groups[-1][0]] == g:
            groups[-1].append(i)
        else:
            groups.append([i])
    chunks = np.array_split(np.arange(len(groups)), min(updates, len(groups)))
    return [[i for g in chunk for i in groups[g]] for chunk in chunks if len(chunk)]


def overlong_penalty(generated: np.ndarray, max_len: int, cache_len: int) -> np.ndarray:
    """DAPO soft overlong punishment per sample from its generated-token count |y|:
    0 if |y| ≤ L_max − L_cache; (L_max − L_cache − |y|) / L_cache up to L_max; −1 beyond."""
    y = np.asarray(generated, dtype=np.float64)
    free = max_len - cache_len
    return np.where(y <= free, 0.0, np.where(y <= max_len, (free - y) / cache_len, -1.0))


def informative_groups(rewards: np.ndarray, group_ids: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """bool [N]: samples whose group's scored (ok) rewards are not all equal (DAPO dynamic
    sampling keeps those: an all-equal group has zero advantage)."""
    keep = np.zeros(len(rewards), dtype=bool)
    for g in dict.fromkeys(np.asarray(group_ids).tolist()):
        rows = np.flatnonzero(group_ids == g)
        r = rewards[rows][ok[rows]]
        keep[rows] = r.size > 1 and bool(np.ptp(r) > 0)
    return keep


@dataclass(frozen=True)
class AdvantageSettings:
    """How sample advantages come from rewards (the module docstring's pipeline)."""

    estimator: str = "grpo"
    advantage_clip: float | None = None
    advantage_balance: bool = False
    overlong: tuple[int, int] | None = None   # (max_len, cache_len)
    credit: str = "outcome"                   # "turn": per-turn returns (axrl.algo.turn_credit)
    gamma: float = 1.0                        # per-turn discount of turn credit (and of GAE)
    lam: float = 1.0                          # GAE's λ (estimator "gae")

    def describe(self) -> str:
        """e.g. "grpo, clipped to ±1, negative mass balanced" (for notes and logs)."""
        parts = [self.estimator if self.estimator != "gae" else f"gae γ={self.gamma:g} λ={self.lam:g}"]
        if self.advantage_clip is not None:
            parts.append(f"clipped to ±{self.advantage_clip:g}")
        if self.advantage_balance:
            parts.append("negative mass balanced")
        if self.overlong is not None:
            parts.append(f"overlong penalty max_len {self.overlong[0]}, cache_len {self.overlong[1]}")
        if self.credit == "turn":
            parts.append(f"turn credit γ={self.gamma:g}")
        return ", ".join(parts)

    def penalties(self, loss_tokens: np.ndarray) -> np.ndarray | None:
        """The overlong penalty per sample (None when off)."""
        if self.overlong is None:
            return None
        return overlong_penalty(loss_tokens, *self.overlong)

    def sample_advantages(self, rewards: np.ndarray, group_ids: np.ndarray, ok: np.ndarray,
                          loss_tokens: np.ndarray) -> torch.Tensor:
        """float32 [N]: advantages of ok samples (0 for the others) from their task rewards."""
        shaped = np.asarray(rewards, dtype=np.float64)
        pen = self.penalties(loss_tokens)
        if pen is not None:
            shaped = shaped + pen
        adv = torch.zeros(len(shaped), dtype=torch.float32)
        okt = torch.from_numpy(np.asarray(ok, dtype=bool))
        if bool(okt.any()) and self.estimator != "gae":  # gae: from the critic's values (`with_gae`)
            r = torch.tensor(shaped, dtype=torch.float32)[okt]
            g = torch.from_numpy(np.asarray(group_ids, dtype=np.int64))[okt]
            adv[okt] = compute_advantages(r, g, estimator=self.estimator).float()
        if self.advantage_clip is not None:
            adv = adv.clamp(-self.advantage_clip, self.advantage_clip)
        if self.advantage_balance:
            n = torch.as_tensor(np.asarray(loss_tokens, dtype=np.float64))
            pos = float((adv.double().clamp(min=0) * n).sum())
            neg = float((-adv.double()).clamp(min=0).mul(n).sum())
            if pos > 0 and neg > 0:
                adv = torch.where(adv < 0, adv * (pos / neg), adv).float()
        return adv


@dataclass
class ProcessedBatch:
    batch: PackedBatch
    trajectories: list[Trajectory]
    sample_advantages: torch.Tensor   # float32 [N]
    rewards: torch.Tensor             # float32 [N], the task rewards
    penalties: np.ndarray | None = None   # float64 [N], overlong penalty added to the reward (None: off)
    dropped_groups: int = 0           # dynamic sampling: groups rolled out but not trained
    rolled_out_groups: int = 0
    turn_rewards: np.ndarray | None = None   # float64 [T]: /tokens/turn_reward (None: not recorded)
    dropped: list[Trajectory] = field(default_factory=list)  # their samples, in rollout order (recorded
                                                             # in the trace's /pool, never trained)
    teacher_logprobs: torch.Tensor | None = None  # float32 [T], on-policy distillation's teacher (algo/distill.py)
    token_rewards: np.ndarray | None = None   # float64 [T], GAE's per-token rewards (algo/gae.py; None: not gae)
    values: torch.Tensor | None = None        # float32 [T], the critic's values GAE used (/tokens/value)
    returns: torch.Tensor | None = None       # float32 [T], GAE's returns, the critic's targets (/tokens/return)

    def update_splits(self, updates: int) -> list[list[int]]:
        """Sample indices of each optimizer update (`update_splits` over the batch's group ids)."""
        return update_splits([t.group_id for t in self.trajectories], updates)


class AlgorithmProcessor:
    """Turns rollout groups into the trainer's batch.

    Failed trajectories (an env or tool raised) stay in the batch — and so in the trace — with an
    all-zero loss mask, and are left out of their group's reward statistics. With `keep_groups`
    (dynamic sampling) only the first `keep_groups` groups whose rewards differ are kept; the
    others are handed back as `ProcessedBatch.dropped` (the trace records them under /pool).
    """

    def __init__(self, estimator: str = "grpo", normalize_std: bool = True, temperature: float = 1.0, *,
                 settings: AdvantageSettings | None = None, keep_groups: int | None = None) -> None:
        if estimator == "grpo" and not normalize_std:
            estimator = "dr_grpo"
        self.settings = settings if settings is not None else AdvantageSettings(estimator)
        self.estimator = self.settings.estimator
        self.temperature = temperature
        self.keep_groups = keep_groups

    def _dynamic_sampling(self, trajectories: list[Trajectory]
                          ) -> tuple[list[Trajectory], list[Trajectory], int]:
        """(kept, dropped, groups rolled out)."""
        groups = list(dict.fromkeys(t.group_id for t in trajectories))
        if self.keep_groups is None:
            return trajectories, [], len(groups)
        rewards = np.asarray([t.reward for t in trajectories], dtype=np.float64)
        gids = np.asarray([t.group_id for t in trajectories])
        ok = np.asarray([t.status == "ok" for t in trajectories])
        useful = informative_groups(rewards, gids, ok)
        keep = [g for g in groups if useful[gids == g].all()][: self.keep_groups]
        if not keep:  # nothing informative: train the first groups as rolled out (zero advantage)
            keep = groups[: self.keep_groups]
        chosen = set(keep)
        return ([t for t in trajectories if t.group_id in chosen], [t for t in trajectories if t.group_id not in chosen],
                len(groups))

    def __call__(self, trajectories: list[Trajectory]) -> ProcessedBatch:
        if not trajectories:
            raise ValueError("AlgorithmProcessor: no trajectories to process")
        trajectories, dropped, rolled_out = self._dynamic_sampling(trajectories)
        dropped_groups = len(dict.fromkeys(t.group_id for t in dropped))
        ok = np.asarray([t.status == "ok" for t in trajectories])
        rewards = np.asarray([t.reward for t in trajectories], dtype=np.float64)
        groups = np.asarray([t.group_id for t in trajectories], dtype=np.int64)
        loss_tokens = np.asarray([t.num_generated * bool(t.status == "ok") for t in trajectories], dtype=np.float64)
        adv = self.settings.sample_advantages(rewards, groups, ok, loss_tokens)

        lengths = torch.tensor([t.num_tokens for t in trajectories], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        loss_mask = torch.from_numpy(np.concatenate([t.loss_mask.astype(np.float32) * float(t.status == "ok")
                                                     for t in trajectories]))
        advantages = token_advantages(adv, offsets, loss_mask)
        if self.settings.credit == "turn":  # per-turn returns and advantages: axrl.algo.turn_credit
            adv, advantages = turn_credit_advantages(
                self.settings, rewards, [t.turn_rewards for t in trajectories],
                np.asarray([t.num_turns for t in trajectories]), groups, ok, offsets, loss_mask,
                np.concatenate([t.turn for t in trajectories]))
        rewards_on_tokens = None
        if self.settings.estimator == "gae":
            rewards_on_tokens = gae_token_rewards(
                self.settings, rewards, offsets, loss_mask, np.concatenate([t.turn for t in trajectories]),
                [t.turn_rewards for t in trajectories], [t.num_turns for t in trajectories])
        routed = None
        if all(t.routed_experts is not None for t in trajectories):
            routed = torch.from_numpy(np.concatenate([t.routed_experts for t in trajectories]).astype(np.int64))
        batch = PackedBatch(
            input_ids=torch.from_numpy(np.concatenate([t.token_ids for t in trajectories]).astype(np.int64)),
            offsets=offsets,
            loss_mask=loss_mask,
            advantages=advantages,
            rollout_logprobs=torch.from_numpy(np.concatenate([t.rollout_logprob for t in trajectories])),
            routed_experts=routed,
            temperature=self.temperature,
        )
        return ProcessedBatch(batch=batch, trajectories=trajectories, sample_advantages=adv,
                              rewards=torch.tensor(rewards, dtype=torch.float32),
                              penalties=self.settings.penalties(loss_tokens), dropped_groups=dropped_groups,
                              rolled_out_groups=rolled_out, dropped=dropped,
                              turn_rewards=self._turn_reward_column(trajectories), token_rewards=rewards_on_tokens)

    def _turn_reward_column(self, trajectories: list[Trajectory]) -> np.ndarray | None:
        """/tokens/turn_reward when it is recorded (`records_turn_rewards`), else None."""
        if not records_turn_rewards(self.settings.credit, [t.turn_rewards for t in trajectories]):
            return None
        return np.concatenate([turn_reward_column(t.turn_rewards, t.turn) for t in trajectories])


def gae_advantages(settings: AdvantageSettings, rewards: np.ndarray, values: torch.Tensor, offsets: torch.Tensor,
                   loss_mask: torch.Tensor, turn: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(token advantages, returns) float32 [T]: GAE from the per-token `rewards` and the critic's
    `values`, advantages whitened over the trained tokens, then `advantage_clip` (axrl.algo.gae)."""
    adv, ret = gae(rewards, values, offsets, loss_mask, turn, settings.gamma, settings.lam)
    adv = whiten(adv, loss_mask)
    if settings.advantage_clip is not None:
        adv = adv.clamp(-settings.advantage_clip, settings.advantage_clip)
    return adv, ret


def gae_token_rewards(settings: AdvantageSettings, rewards: np.ndarray, offsets: torch.Tensor,
                      loss_mask: torch.Tensor, turn: np.ndarray, turn_rewards: Sequence[Sequence[float]],
                      num_turns: Sequence[int]) -> np.ndarray:
    """float64 [T]: the samples' task rewards (+ overlong penalty) placed on their trained tokens
    for GAE (`axrl.algo.gae.token_rewards`, by `settings.credit`)."""
    mask = torch.as_tensor(loss_mask).reshape(-1)
    loss_tokens = np.diff(np.concatenate([[0.0], np.cumsum(mask.double().numpy())])[torch.as_tensor(offsets).numpy()])
    pen = settings.penalties(loss_tokens)
    shaped = np.asarray(rewards, np.float64) + (0.0 if pen is None else pen)
    return token_rewards(shaped, offsets, loss_mask, turn, credit=settings.credit, turn_rewards=turn_rewards,
                         num_turns=num_turns)


def with_gae(processed: ProcessedBatch, values: torch.Tensor, settings: AdvantageSettings) -> ProcessedBatch:
    """The batch with GAE's advantages (whitened, then `advantage_clip`) from the critic's `values`
    [T] (kept on the trained tokens, 0 elsewhere), its returns and those values recorded (axrl.algo.gae). A sample's advantage is that of
    its first trained token (0 without one)."""
    assert processed.token_rewards is not None, "with_gae needs a batch processed under advantage: gae"
    b = processed.batch
    turn = np.concatenate([t.turn for t in processed.trajectories])
    values = torch.where(b.loss_mask > 0, values.float(), torch.zeros_like(values, dtype=torch.float32))
    adv, ret = gae_advantages(settings, processed.token_rewards, values, b.offsets, b.loss_mask, turn)
    first = torch.zeros(b.num_samples, dtype=torch.float32)
    mask = b.loss_mask.numpy() > 0
    for i in range(b.num_samples):
        hit = np.flatnonzero(mask[int(b.offsets[i]):int(b.offsets[i + 1])])
        if hit.size:
            first[i] = adv[int(b.offsets[i]) + int(hit[0])]
    processed.batch = dataclasses.replace(b, advantages=adv)
    processed.sample_advantages, processed.values, processed.returns = first, values, ret
    return processed
