"""RolloutWorker: runs every sample of a step's prompts as concurrent agent episodes."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass

from axrl.agents.tasks import Task
from axrl.agents.env import Prompt
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.rollout.agent_loop import run_episode
from axrl.rollout.lockstep import EpisodeEngine, LockstepEngine
from axrl.rollout.pool import TrajectoryPool
from axrl.rollout.trajectory import Trajectory
from axrl.tokenizer import Tokenizer


def sample_seed(seed: int, step: int, sample_id: int) -> int:
    """A sampling seed that depends only on (run seed, step, sample): reruns draw the same tokens
    whatever order the engine happened to batch requests in."""
    digest = hashlib.blake2b(f"{seed}:{step}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class RolloutSettings:
    group_size: int
    sampling: SamplingParams
    max_turns: int
    max_context_len: int
    return_routing: bool
    lockstep: bool = True  # deterministic batch composition (see axrl/rollout/lockstep.py)


class RolloutWorker:
    """Drives one engine: every prompt × group_size episodes in flight at once (the engine
    batches them continuously), results into the TrajectoryPool as they finish."""

    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, task: Task, settings: RolloutSettings,
                 seed: int) -> None:
        self.engine, self.tokenizer, self.task, self.settings, self.seed = engine, tokenizer, task, settings, seed

    async def _episode(self, engine: InferenceEngine | EpisodeEngine, prompt: Prompt, step: int, sample_id: int,
                       group_id: int, pool: TrajectoryPool) -> None:
        s = self.settings
        sampling = dataclasses.replace(s.sampling, seed=sample_seed(self.seed, step, sample_id))
        try:
            traj = await run_episode(engine, self.tokenizer, self.task.make_env(), prompt,
                                     sample_id=sample_id, group_id=group_id, sampling=sampling,
                                     max_turns=s.max_turns, max_context_len=s.max_context_len,
                                     return_routing=s.return_routing)
        finally:
            if isinstance(engine, EpisodeEngine):
                engine.finished()
        pool.add(traj)

    async def _rollout(self, prompts: list[Prompt], step: int, pool: TrajectoryPool) -> None:
        n = self.settings.group_size
        first_group = step * len(prompts)
        lockstep = LockstepEngine(self.engine) if self.settings.lockstep else None
        episodes = []
        for g, prompt in enumerate(prompts):
            for j in range(n):
                sample_id = (first_group + g) * n + j
                engine = lockstep.episode(sample_id) if lockstep else self.engine
                episodes.append(self._episode(engine, prompt, step, sample_id, first_group + g, pool))
        await asyncio.gather(*episodes)

    def rollout(self, prompts: list[Prompt], step: int) -> list[Trajectory]:
        """All samples of the step's prompts, grouped and in a deterministic order."""
        pool = TrajectoryPool(self.settings.group_size)
        asyncio.run(self._rollout(prompts, step, pool))
        return pool.pop_complete()
