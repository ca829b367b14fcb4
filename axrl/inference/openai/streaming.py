"""The SSE path of the OpenAI endpoints: OpenAI's chunks from each choice's progress.

A backend reports, per poll, each choice's progress: the text that may be sent so far
(cumulative; held back where it could still become a stop string or a tool call), its `Final`
state once it ended, or None when nothing changed. `sse_stream` turns that into chunks —
chat: a role chunk per choice, `reasoning_content` and content deltas, one `tool_calls` delta, a
finish chunk;
completions: text chunks, a finish chunk — then the usage chunk if asked, then `data: [DONE]`.
`axrl serve` and the agent proxy report progress as tokens arrive (`merge` follows a call's n
requests together).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, AsyncIterator, Callable, TypeVar, Union

from axrl.inference.openai.replies import Envelope

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse(obj: Any) -> bytes:
    """One server-sent event holding `obj` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclasses.dataclass
class Final:
    """A choice that ended: its whole content (chat: the text before any tool call), its tool
    calls, finish reason, and fields its finish chunk carries beside them (`extras`)."""

    content: str | None
    finish_reason: str
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    reasoning: str | None = None  # the family's reasoning, sent as `delta.reasoning_content`


@dataclasses.dataclass
class Reasoned:
    """A running chat reply split by the family's reasoning parser: the reasoning and the content
    sendable so far (both cumulative), streamed as `reasoning_content` and `content` deltas."""

    reasoning: str
    content: str


# One choice's news of a poll: the text sendable so far (split or not), its end, or nothing new.
Progress = Union[str, Reasoned, Final, None]


class _Chunks:
    """The chunks of one call's stream."""

    def __init__(self, envelope: Envelope) -> None:
        self.head, self.chat = envelope.head(stream=True), envelope.chat

    def choice(self, k: int, text: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
        """One choice's chunk: chat puts the text (and tool calls, role) in a delta."""
        if self.chat:
            delta = {**({"content": text} if text is not None else {}),
                     **{key: extra.pop(key) for key in ("role", "reasoning_content", "tool_calls") if key in extra}}
            choice: dict[str, Any] = {"index": k, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": k, "text": text or "", "logprobs": None, "finish_reason": finish}
        return sse({**self.head, "choices": [{**choice, **extra}]})

    def final(self, k: int, state: Final, sent: int, sent_reasoning: int = 0) -> list[bytes]:
        """The chunks that end choice k: the reasoning and the content not sent yet, its tool calls,
        its finish."""
        out = []
        thought = (state.reasoning or "")[sent_reasoning:]
        if thought:
            out.append(self.choice(k, None, reasoning_content=thought))
        rest = (state.content or "")[sent:]
        if rest:
            out.append(self.choice(k, rest))
        if state.tool_calls:
            out.append(self.choice(k, None, tool_calls=[{"index": i, **c} for i, c in enumerate(state.tool_calls)]))
        out.append(self.choice(k, None, state.finish_reason, **state.extras))
        return out

    def usage(self, usage: dict[str, Any]) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage})


async def sse_stream(envelope: Envelope, n: int, progress: AsyncIterator[list[Progress]],
                     usage: Callable[[], dict[str, Any]] | None) -> AsyncIterator[bytes]:
    """The SSE chunks of `n` choices from their `progress` (a list of `Progress` per poll);
    `usage()` is sent at the end when given and every choice finished. An error once the headers
    went out is reported in-band, then `[DONE]`."""
    chunks = _Chunks(envelope)
    sent, finished = [0] * n, [False] * n   # characters of each reply already sent; its end sent
    thought = [0] * n                       # characters of each reply's reasoning already sent
    try:
        if envelope.chat:
            for k in range(n):
                yield chunks.choice(k, "", role="assistant")
        async for states in progress:
            for k, state in enumerate(states):
                if finished[k] or state is None:
                    continue
                if isinstance(state, Final):
                    finished[k] = True
                    for chunk in chunks.final(k, state, sent[k], thought[k]):
                        yield chunk
                    continue
                if isinstance(state, Reasoned):
                    if len(state.reasoning) > thought[k]:
                        yield chunks.choice(k, None, reasoning_content=state.reasoning[thought[k]:])
                        thought[k] = len(state.reasoning)
                    state = state.content
                if len(state) > sent[k]:
                    yield chunks.choice(k, state[sent[k]:])
                    sent[k] = len(state)
        if usage is not None and all(finished):
            yield chunks.usage(usage())
        yield DONE
    except Exception as e:  # noqa: BLE001 — errors after the headers went out are reported in-band
        yield sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError"}})
        yield DONE


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) of several async iterators, each item as soon as it arrives (a call's n
    choices, each followed on its own). Stopping early cancels the pending reads and closes every
    iterator, so their own cleanup (aborting a request) runs before this returns."""
    pending = {asyncio.ensure_future(anext(s)): k for k, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # a stable order within one wake-up
                k = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[k]))] = k
                yield k, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]
