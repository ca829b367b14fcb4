"""The deterministic engine clock: one rollout driver owns a `ClockedEngine` and decides what
every scheduler iteration sees.

Why: under free-running continuous batching, which requests share a decode batch depends on
thread timing, and batch composition changes GEMM shapes and so the last bits of the logprobs
(and, rarely, a sampled token). Here nothing depends on time. Between two engine iterations the
clock *settles*: every episode woken by the last iteration runs (its env step, its next
request) until it is waiting on the engine again or has finished; only then are the new
requests submitted — all at once, in key (sample id) order — and the next iteration runs. The
schedule is therefore a pure function of counts (iterations, finished requests), and so is
every token, logprob and routing row.

On a `ClockedEngine` (the embedded engine) a tick is one scheduler iteration, so a turn that
finishes joins the very next iteration and a long episode never holds the others back. An
engine that schedules its own batches (an SGLang server) is clocked by *rounds* instead: a tick
waits until every request of the round has finished, so each round reaches the server as one
batched submission — deterministic batch composition for a server that admits a batch
together (`axrl serve`), at the price of waiting for the slowest request of each round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field

from axrl.inference.protocol import ClockedEngine, GenerateRequest, GenerateResult, InferenceEngine


@dataclass(order=True)
class _Submission:
    key: tuple[int, int]
    request: GenerateRequest = field(compare=False)
    future: asyncio.Future = field(compare=False)


class EngineClock:
    """Hands requests of many episodes to one clocked engine, one settled iteration at a time.

    Episodes call `generate` (through their `EpisodeEngine`); the driver loop calls `settle`,
    `flush` and `tick` in turn. All of it runs on one event loop, in one thread.
    """

    def __init__(self, engine: InferenceEngine, *, rounds: bool = False) -> None:
        if not rounds and not isinstance(engine, ClockedEngine):
            raise TypeError(f"{type(engine).__name__} has no step(): clock it by rounds")
        self.engine, self.rounds = engine, rounds
        self._busy = 0                                  # episodes running between two requests
        self._settled = asyncio.Event()
        self._settled.set()
        self._pending: list[_Submission] = []           # requested since the last flush
        self._inflight: list[tuple[concurrent.futures.Future, asyncio.Future]] = []
        self._order = 0                                 # tie-break: one episode may ask twice (splices)

    # -- episode side ----------------------------------------------------------------------------
    def started(self) -> None:
        """An episode was created: it runs until its first request."""
        self._busy += 1
        self._settled.clear()

    def finished(self) -> None:
        """An episode ended (or failed): the clock no longer waits for it."""
        self._release()

    async def generate(self, key: int, request: GenerateRequest) -> GenerateResult:
        future = asyncio.get_running_loop().create_future()
        self._order += 1
        self._pending.append(_Submission((key, self._order), request, future))
        self._release()
        return await future

    def _release(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._settled.set()

    # -- driver side -----------------------------------------------------------------------------
    async def settle(self) -> None:
        """Wait until every live episode is waiting on the engine or has finished."""
        await self._settled.wait()

    @property
    def idle(self) -> bool:
        """Nothing submitted and nothing in the engine: only an outside event can make work."""
        return not self._pending and not self._inflight

    def flush(self) -> None:
        """Submit everything requested since the last flush, in key order, atomically."""
        if not self._pending:
            return
        batch, self._pending = sorted(self._pending), []
        try:
            futures = self.engine.submit_many([s.request for s in batch])
        except Exception as e:  # noqa: BLE001 — a rejected submission fails the episodes that made it
            for sub in batch:
                self._busy += 1
                self._settled.clear()
                sub.future.set_exception(e)
            return
        for sub, cf in zip(batch, futures):
            self._inflight.append((cf, sub.future))

    async def tick(self) -> None:
        """One engine iteration (or round); wake, in submission order, the episodes whose requests
        finished."""
        if self.rounds:
            await asyncio.wait([asyncio.wrap_future(cf) for cf, _ in self._inflight])
        else:
            self.engine.step()  # type: ignore[attr-defined]
        still = []
        for cf, future in self._inflight:
            if not cf.done():
                still.append((cf, future))
                continue
            if future.cancelled():
                continue
            self._busy += 1
            self._settled.clear()
            error = cf.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(cf.result())
        self._inflight = still
