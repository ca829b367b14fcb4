"""Held-out evaluation: the same prompts and sampling seeds every time, on an engine of its own.

The evaluator's engine is separate from the rollout engine so that an evaluation never mixes
into (or waits for) rollouts of an asynchronous run, and holds exactly the weights being
evaluated. Evaluations of successive policies then differ only by the policy.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

import torch
from pydantic import Field

from axrl.agents.tasks import Task
from axrl.core.settings import Section
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import InferenceEngine
from axrl.rollout.runner import Clock, EpisodeRunner, EpisodeSpec, Player, RolloutSettings, run_all, sample_seed
from axrl.tokenizer import Tokenizer


class EvalSettings(Section):
    """Held-out evaluation (the YAML section `eval`): the same prompts and sampling seeds every
    time, so evaluations of successive policies differ only by the policy."""

    every: int = Field(0, ge=0, description="evaluate before every K-th step and after the last (0 = off)")
    prompts: int = Field(32, ge=1)
    samples_per_prompt: int = Field(2, ge=1)


class Evaluator:
    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, task: Task, settings: RolloutSettings, *,
                 prompts: int, seed: int, clock: Clock, player: Player | None = None) -> None:
        self.engine, self.tokenizer, self.task, self.settings, self.clock = engine, tokenizer, task, settings, clock
        self.player = player  # a black-box agent (axrl.rollout.blackbox), else the task's env
        n = settings.group_size
        # Prompts of the held-out stream (task seed + 2), never trained on.
        self.specs = [EpisodeSpec(g * n + j, g, task.prompt(seed + 2, g), sample_seed(seed + 2, g * n + j))
                      for g in range(prompts) for j in range(n)]

    def evaluate(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Mean reward of the policy `weights` (weight version `version`) over the held-out set."""
        self.engine.update_weights(dict(weights), version=version)
        trajectories: list[Trajectory] = []
        runner = EpisodeRunner(self.engine, self.tokenizer, self.task.make_env, self.settings, clock=self.clock,
                               on_done=lambda spec, traj: trajectories.append(traj), player=self.player)
        asyncio.run(run_all(runner, self.specs))
        return sum(t.reward for t in trajectories) / len(trajectories)

    def close(self) -> None:
        """Shut its engine down."""
        self.engine.shutdown()
