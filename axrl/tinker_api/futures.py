"""Futures of the Tinker API: every operation returns `{"request_id"}` at once and its result is
fetched with `retrieve_future`, which long-polls (waits up to `poll_s` for the result, then answers
`try_again`, and the client polls again at once).

Ordering: the requests of one training model run in `seq_id` order (a request waits for its turn,
at most `gap_s` for a missing earlier one). A POST retried with a (model, seq_id) already seen is
answered with the first one's future and never runs twice.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

from axrl.tinker_api.errors import UserError

log = logging.getLogger("axrl.tinker_api")

Result = tuple[str, Any]    # ("json", dict) | ("proto", bytes)


@dataclass
class _Entry:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Result | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # fields of the immediate answer (sample_sequence_ids)


def error_result(e: BaseException) -> Result:
    """The SDK's failed-request answer: category "user" for a client mistake, else "server"."""
    if isinstance(e, UserError):
        return "json", {"error": str(e), "category": "user"}
    log.exception("request failed", exc_info=e)
    return "json", {"error": f"{type(e).__name__}: {e}", "category": "server"}


class FutureStore:
    """Pending and finished requests (the newest `keep` results are kept for re-polls)."""

    def __init__(self, poll_s: float = 30.0, gap_s: float = 10.0, keep: int = 4096) -> None:
        self.poll_s, self.gap_s, self.keep = poll_s, gap_s, keep
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.by_seq: dict[tuple[str, int], str] = {}
        self.next_seq: dict[str, int] = {}
        self._turn: asyncio.Condition | None = None

    @property
    def turn(self) -> asyncio.Condition:
        if self._turn is None:       # created on the server's event loop
            self._turn = asyncio.Condition()
        return self._turn

    def open_model(self, model_id: str, first_seq: int = 1) -> None:
        """Start ordering a model's requests (the SDK numbers them from 1)."""
        self.next_seq.setdefault(model_id, first_seq)

    async def submit_ordered(self, model_id: str, seq_id: int, fn: Callable[[], Result], executor: Executor,
                             extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Run `fn` on `executor` in the model's seq_id order; (request id, immediate extras).
        A (model, seq_id) seen before returns the first request's id without running `fn`."""
        key = (model_id, seq_id)
        if key in self.by_seq:
            rid = self.by_seq[key]
            return rid, self.entries[rid].extra if rid in self.entries else {}
        async with self.turn:
            try:
                await asyncio.wait_for(self.turn.wait_for(lambda: self.next_seq.get(model_id, seq_id) >= seq_id),
                                       self.gap_s)
            except asyncio.TimeoutError:
                log.warning("model %s: seq_id %d waited %.0f s for an earlier request; running it", model_id,
                            seq_id, self.gap_s)
            if key in self.by_seq:          # a retry that raced the first
                rid = self.by_seq[key]
                return rid, self.entries[rid].extra if rid in self.entries else {}
            rid = self.submit(fn, executor, extra)
            self.by_seq[key] = rid
            self.next_seq[model_id] = max(self.next_seq.get(model_id, 0), seq_id + 1)
            self.turn.notify_all()
        return rid, extra or {}

    def submit(self, fn: Callable[[], Result], executor: Executor, extra: dict[str, Any] | None = None) -> str:
        """Run `fn` on `executor` (submission order = execution order on a one-thread executor)."""
        rid = uuid.uuid4().hex
        entry = self.entries[rid] = _Entry(extra=extra or {})
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(executor, _guarded, fn)

        def finish(f: asyncio.Future) -> None:
            entry.result = f.result()
            entry.done.set()
        work.add_done_callback(finish)
        self._evict()
        return rid

    def complete(self, result: Result) -> str:
        """A request whose answer is known already."""
        rid = uuid.uuid4().hex
        entry = self.entries[rid] = _Entry(result=result)
        entry.done.set()
        self._evict()
        return rid

    def _evict(self) -> None:
        while len(self.entries) > self.keep:
            rid, entry = next(iter(self.entries.items()))
            if not entry.done.is_set():
                break
            del self.entries[rid]

    async def retrieve(self, request_id: str) -> Result:
        """The result, waiting up to poll_s; `try_again` when it is still running."""
        entry = self.entries.get(request_id)
        if entry is None:
            return "json", {"error": f"unknown request_id {request_id!r} (never issued by this server, or "
                                     "its result was dropped long ago)", "category": "user"}
        try:
            await asyncio.wait_for(entry.done.wait(), self.poll_s)
        except asyncio.TimeoutError:
            return "json", {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        assert entry.result is not None
        return entry.result


def _guarded(fn: Callable[[], Result]) -> Result:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every failure becomes the request's answer, never the server's
        return error_result(e)
