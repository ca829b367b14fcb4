"""What the step trainer returns: one trained step (`TrainedStep`) with its updates and critic
updates, in the order they happened. The learner records it (`axrl.runtime.recording.builders`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from axrl.algo.processor import ProcessedBatch
from axrl.rollout.pool import Batch
from axrl.train.critic import CriticUpdate
from axrl.train.protocol import ForwardResult, StepStats, TrainMetrics


@dataclass
class UpdateResult:
    samples: list[int]
    metrics: TrainMetrics
    stats: StepStats
    fingerprint: str


@dataclass
class CriticStep:
    """The critic's updates of one step and its weights' fingerprints around them."""

    updates: list[CriticUpdate]
    fingerprint_before: str
    fingerprint_after: str


@dataclass
class TrainedStep:
    """Everything the loop learned in one step, in the order it happened."""

    step: int
    policy_version: int
    batch: Batch                            # what the pool handed over (groups, drops, re-runs)
    processed: ProcessedBatch
    old: ForwardResult
    updates: list[UpdateResult]
    fingerprint_before: str
    fingerprint_after: str
    behaviour: torch.Tensor | None = None   # float32 [T]: trainer logprob under each token's generating weights
    wall_times: dict[str, float] = field(default_factory=dict)
    num_experts: int = 0
    marks: dict[str, Any] = field(default_factory=dict)   # extra root attrs of the step file (e.g. spike)
    critic: CriticStep | None = None        # PPO's critic updates (algo.advantage: gae)
