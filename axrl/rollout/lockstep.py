"""Lock-step rollout: many concurrent episodes, one deterministic engine batch per round.

Under free-running continuous batching, which requests share a decode batch depends on thread
timing, and batch composition changes GEMM shapes and so the last bits of the logprobs (and,
rarely, a sampled token). For bit-for-bit reproducible runs, `LockstepEngine` holds each
episode's next request until every live episode has either submitted one or finished, then
submits them all at once in sample-id order. With no arrivals mid-round the embedded engine's
schedule is a pure function of the requests. A round waits for its slowest episode: the price
of determinism, small when episodes have few turns.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from axrl.inference.protocol import GenerateRequest, GenerateResult, InferenceEngine


@dataclass(order=True)
class _Pending:
    key: int
    request: GenerateRequest = field(compare=False)
    future: asyncio.Future = field(compare=False)


class LockstepEngine:
    """Wraps an engine for one rollout; `episode(key)` gives each episode its own handle."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._live = 0
        self._pending: list[_Pending] = []

    def episode(self, key: int) -> "EpisodeEngine":
        self._live += 1
        return EpisodeEngine(self, key)

    def _finished(self) -> None:
        self._live -= 1
        self._flush_if_ready()

    async def _generate(self, key: int, request: GenerateRequest) -> GenerateResult:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(key, request, future))
        self._flush_if_ready()
        return await future

    def _flush_if_ready(self) -> None:
        if not self._pending or len(self._pending) < self._live:
            return
        batch, self._pending = sorted(self._pending), []
        submit_many = getattr(self.engine, "submit_many", None)
        if submit_many is None:  # e.g. a remote server, which batches on its own anyway
            for p in batch:
                asyncio.ensure_future(self._relay(self.engine.generate(p.request), p.future))
            return
        for p, cf in zip(batch, submit_many([p.request for p in batch])):
            asyncio.ensure_future(self._relay(asyncio.wrap_future(cf), p.future))

    @staticmethod
    async def _relay(awaitable: Any, future: asyncio.Future) -> None:
        try:
            future.set_result(await awaitable)
        except BaseException as e:  # hand engine errors to the episode that asked
            future.set_exception(e)


class EpisodeEngine:
    """One episode's view of a LockstepEngine: `generate` joins the current round."""

    def __init__(self, lockstep: LockstepEngine, key: int) -> None:
        self._lockstep, self._key = lockstep, key

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self._lockstep._generate(self._key, request)

    def finished(self) -> None:
        """Leave the rollout: later rounds no longer wait for this episode."""
        self._lockstep._finished()

    def __getattr__(self, name: str) -> Any:  # abort, health, weight_version… go to the engine
        return getattr(self._lockstep.engine, name)
