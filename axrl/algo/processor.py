"""AlgorithmProcessor: complete groups of trajectories → rewards → advantages → a packed batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from axrl.algo.advantages import compute_advantages, token_advantages
from axrl.rollout.trajectory import Trajectory
from axrl.train.protocol import PackedBatch


@dataclass
class ProcessedBatch:
    batch: PackedBatch
    trajectories: list[Trajectory]
    sample_advantages: torch.Tensor   # float32 [N]
    rewards: torch.Tensor             # float32 [N]

    def update_splits(self, updates: int) -> list[list[int]]:
        """Sample indices of each optimizer update: `updates` contiguous, near-equal chunks of
        whole groups, in order (the fixed order replay relies on)."""
        groups: list[list[int]] = []
        for i, t in enumerate(self.trajectories):
            if groups and self.trajectories[groups[-1][0]].group_id == t.group_id:
                groups[-1].append(i)
            else:
                groups.append([i])
        chunks = np.array_split(np.arange(len(groups)), min(updates, len(groups)))
        return [[i for g in chunk for i in groups[g]] for chunk in chunks if len(chunk)]


class AlgorithmProcessor:
    """Turns rollout groups into the trainer's batch.

    Failed trajectories (an env or tool raised) stay in the batch — and so in the trace — with an
    all-zero loss mask, and are left out of their group's reward statistics.
    """

    def __init__(self, estimator: str = "grpo", normalize_std: bool = True, temperature: float = 1.0) -> None:
        if estimator == "grpo" and not normalize_std:
            estimator = "dr_grpo"
        self.estimator = estimator
        self.temperature = temperature

    def __call__(self, trajectories: list[Trajectory]) -> ProcessedBatch:
        if not trajectories:
            raise ValueError("AlgorithmProcessor: no trajectories to process")
        ok = torch.tensor([t.status == "ok" for t in trajectories])
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.int64)
        adv = torch.zeros(len(trajectories), dtype=torch.float32)
        if bool(ok.any()):
            adv[ok] = compute_advantages(rewards[ok], groups[ok], estimator=self.estimator).float()

        lengths = torch.tensor([t.num_tokens for t in trajectories], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        loss_mask = torch.from_numpy(np.concatenate([t.loss_mask.astype(np.float32) * float(t.status == "ok")
                                                     for t in trajectories]))
        routed = None
        if all(t.routed_experts is not None for t in trajectories):
            routed = torch.from_numpy(np.concatenate([t.routed_experts for t in trajectories]).astype(np.int64))
        batch = PackedBatch(
            input_ids=torch.from_numpy(np.concatenate([t.token_ids for t in trajectories]).astype(np.int64)),
            offsets=offsets,
            loss_mask=loss_mask,
            advantages=token_advantages(adv, offsets, loss_mask),
            rollout_logprobs=torch.from_numpy(np.concatenate([t.rollout_logprob for t in trajectories])),
            routed_experts=routed,
            temperature=self.temperature,
        )
        return ProcessedBatch(batch=batch, trajectories=trajectories, sample_advantages=adv, rewards=rewards)
