"""Rollout plumbing: the group pool, lock-step rounds, per-sample seeds."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.rollout.lockstep import LockstepEngine
from axrl.rollout.pool import TrajectoryPool
from axrl.rollout.trajectory import Trajectory
from axrl.rollout.worker import sample_seed


class RecordingEngine:
    """Answers every request with one token and records how requests were batched."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def submit_many(self, requests: list[GenerateRequest]) -> list[concurrent.futures.Future]:
        self.batches.append([r.input_ids[0] for r in requests])
        futures = []
        for r in requests:
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_result(GenerateResult(rid=r.rid, output_ids=[7], output_logprobs=[0.0], routed_experts=None,
                                        finish_reason={"type": "stop", "matched": 7}, weight_version=0))
            futures.append(f)
        return futures


def test_lockstep_submits_whole_rounds_in_key_order():
    engine = RecordingEngine()

    async def episode(handle, key: int, turns: int, delays: list[float]) -> None:
        try:
            for t in range(turns):
                await asyncio.sleep(delays[t])  # arrival order differs from key order
                await handle.generate(GenerateRequest(input_ids=[key]))
        finally:
            handle.finished()

    async def main() -> None:
        lock = LockstepEngine(engine)
        specs = {3: (1, [0.02]), 1: (3, [0.03, 0.0, 0.01]), 2: (2, [0.0, 0.02])}
        await asyncio.gather(*(episode(lock.episode(k), k, n, d) for k, (n, d) in specs.items()))

    asyncio.run(main())
    # Round 1: everyone; round 2: episodes with >= 2 turns; round 3: only episode 1.
    assert engine.batches == [[1, 2, 3], [1, 2], [1]]


def test_pool_releases_complete_groups_sorted_by_sample():
    pool = TrajectoryPool(group_size=2)
    for sid, gid in [(5, 1), (2, 0), (4, 1)]:
        pool.add(Trajectory(sample_id=sid, group_id=gid, prompt_id="p"))
    assert [t.sample_id for t in pool.pop_complete()] == [4, 5]
    assert len(pool) == 1 and pool.num_complete() == 0
    with pytest.raises(ValueError, match="already has 2"):
        pool.add(Trajectory(sample_id=3, group_id=0, prompt_id="p"))
        pool.add(Trajectory(sample_id=6, group_id=0, prompt_id="p"))


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(0, 3, 17) == sample_seed(0, 3, 17)
    seeds = {sample_seed(s, st, i) for s in range(2) for st in range(3) for i in range(50)}
    assert len(seeds) == 2 * 3 * 50
