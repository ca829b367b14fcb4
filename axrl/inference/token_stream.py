"""Tokens as they are generated: a request in flight, followed until it ends.

Every engine settles a request's future once, with the whole result. Streaming front-ends (the
OpenAI-compatible routes of `axrl serve` and of the agent proxy, `axrl serve`'s SGLang
`/generate`) also want the tokens in between; `follow` gives them, for any engine, as a sequence
of snapshots ending with the `GenerateResult`:

* engines that implement `ReportsProgress` (the embedded engine; the SGLang client for requests
  submitted with `stream=True`) are asked for the request's progress each time the result is
  not there yet, at most every `poll_s` — so a chunk reaches the client within one poll of the
  token being sampled, and nothing is polled once the request ended;
* other engines yield the final result only (a stream with one chunk).

A snapshot is cumulative (the ids so far), as SGLang's own stream chunks are; a consumer sends
what it has not sent yet. Polling rather than a callback keeps the engines' scheduler threads
free of consumers' code: a slow client never delays a decode step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import AsyncIterator, Union

from axrl.inference.protocol import GenerateResult, ReportsProgress

STREAM_POLL_S = 0.005  # a decode step of the embedded engine takes a few ms at the batch sizes it runs

Partial = tuple[list[int], list[float]]
Snapshot = Union[Partial, GenerateResult]


async def follow(engine: object, rid: str, future: concurrent.futures.Future | asyncio.Future,
                 poll_s: float = STREAM_POLL_S) -> AsyncIterator[Snapshot]:
    """Yield (output ids, logprobs) each time request `rid` has new tokens, then its result.

    `future` is the request's engine future (`submit` / `submit_many`), already submitted; the
    caller aborts the request if it stops iterating early (the consumer went away)."""
    waiting = asyncio.wrap_future(future) if isinstance(future, concurrent.futures.Future) else future
    if not isinstance(engine, ReportsProgress):
        yield await waiting
        return
    sent = 0
    while not waiting.done():
        await asyncio.wait([waiting], timeout=poll_s)
        snap = None if waiting.done() else engine.progress(rid)
        if snap is not None and len(snap[0]) > sent:
            sent = len(snap[0])
            yield snap
    yield waiting.result()
