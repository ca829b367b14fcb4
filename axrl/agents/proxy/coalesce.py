"""CallCoalescer: model calls that arrive together reach the engine together.

Agents call the proxy independently, so calls that are in effect simultaneous (a group of
episodes started at once, a step's worth of agents answering their tool results) reach it a
few milliseconds apart — the HTTP parsing and the template of each take a moment, on the cores
the engine computes on. Submitted one by one, each lands in a different engine iteration: the
engine prefills them in several small forwards instead of one batched one, and decodes with
fewer rows while the stragglers trickle in (`bench/proxy_overhead.py` measured the proxy at
0.71 of one batched submission that way). The coalescer holds a call until no other call has
joined it for `window_s` (at most `max_wait_s` after the first), then submits them all at once.

Measured on the 2-core box (docs/agents.md, "What the proxy costs"), it did not make the proxy
faster there: once the agents' side is not the bottleneck, calls arrive fast enough that the
engine admits them in a few iterations anyway, so `ProxyServer` leaves it off by default
(`coalesce_window_s=0`); it is there for engines where a submission's admission is costlier.

A lone call waits `window_s` and no more. A submit function that can take several requests in
one atomic submission says so with a `many(requests) -> futures` attribute (`engine_submit`);
requests of one flush that share it go to it in one call, which the engine admits together.
Others are called one after another in the same flush (a rollout worker's per-episode handle:
they still reach the engine within the same iteration in practice).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from typing import Any, Callable

from axrl.inference.protocol import GenerateRequest, settle_future

Submit = Callable[[GenerateRequest], concurrent.futures.Future]


class CallCoalescer:
    """Batches `submit(request)` calls of any number of sessions (thread-safe).

    Args:
        window_s: a batch is submitted once no call joined it for this long (0: no coalescing,
            every call is submitted at once).
        max_wait_s: ... and at the latest this long after its first call (a steady stream of
            calls must not hold the first one back).
        max_batch: ... or as soon as it holds this many requests.
    """

    def __init__(self, window_s: float = 0.005, max_wait_s: float = 0.05, max_batch: int = 256) -> None:
        if window_s < 0 or max_wait_s < window_s or max_batch < 1:
            raise ValueError(f"CallCoalescer needs 0 <= window_s <= max_wait_s and max_batch >= 1, got "
                             f"window_s={window_s}, max_wait_s={max_wait_s}, max_batch={max_batch}")
        self.window_s, self.max_wait_s, self.max_batch = window_s, max_wait_s, max_batch
        self._cv = threading.Condition()
        self._pending: list[tuple[Submit, GenerateRequest, concurrent.futures.Future]] = []
        self._first = self._last = 0.0
        self._closed = False
        self.batches = 0          # flushes so far (tests, the bench)
        self._thread: threading.Thread | None = None
        if window_s > 0:
            self._thread = threading.Thread(target=self._run, name="axrl-proxy-coalescer", daemon=True)
            self._thread.start()

    def wrap(self, submit: Submit) -> Submit:
        """`submit` (one session's way to its engine) routed through the coalescer."""
        if self._thread is None:
            return submit
        wrapped = functools.partial(self.submit, submit)
        # the engine behind it, for streamed calls to follow their tokens (`engine_submit.engine`)
        wrapped.engine = getattr(submit, "engine", None)  # type: ignore[attr-defined]
        return wrapped

    def submit(self, submit: Submit, request: GenerateRequest) -> concurrent.futures.Future:
        """Queue `request` for `submit`; the future resolves to its result (cancelling it before
        the flush drops the request, after it cancels the engine's future: an abort)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the proxy's call coalescer is closed")
            now = time.monotonic()
            if not self._pending:
                self._first = now
            self._last = now
            self._pending.append((submit, request, future))
            self._cv.notify()
        return future

    def close(self) -> None:
        """Submit what is pending and stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the flusher thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if not self._pending:
                        if self._closed:
                            return
                        self._cv.wait()
                        continue
                    due = min(self._last + self.window_s, self._first + self.max_wait_s)
                    wait = due - time.monotonic()
                    if wait <= 0 or len(self._pending) >= self.max_batch or self._closed:
                        break
                    self._cv.wait(wait)
                batch, self._pending = self._pending, []
                self.batches += 1
            dispatch(batch)


def dispatch(batch: list[tuple[Submit, GenerateRequest, concurrent.futures.Future]]) -> None:
    """Submit a batch: requests whose submit shares a `many` in one call each, the rest one by one."""
    live = [item for item in batch if not item[2].cancelled()]
    groups: dict[Any, list[tuple[Submit, GenerateRequest, concurrent.futures.Future]]] = {}
    for item in live:
        many = getattr(item[0], "many", None)
        # Bound methods of one engine are equal (and hash alike) though not the same object.
        groups.setdefault(many if many is not None else id(item), []).append(item)
    for items in groups.values():
        many = getattr(items[0][0], "many", None)
        if many is not None and len(items) > 1:
            try:
                inner = many([r for _, r, _ in items])
            except Exception:  # noqa: BLE001 — one bad request must fail alone: submit one by one
                inner = None
            if inner is not None:
                for (_, _, outer), f in zip(items, inner):
                    _chain(f, outer)
                continue
        for submit, request, outer in items:
            try:
                _chain(submit(request), outer)
            except Exception as e:  # noqa: BLE001 — the call's error, raised where it awaits
                settle_future(outer, error=e)


def _chain(inner: concurrent.futures.Future, outer: concurrent.futures.Future) -> None:
    """`outer` resolves with `inner`; cancelling `outer` cancels `inner` (the engine aborts it)."""
    outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())

    def done(f: concurrent.futures.Future) -> None:
        if f.cancelled():
            outer.cancel()
        elif f.exception() is not None:
            settle_future(outer, error=f.exception())
        else:
            settle_future(outer, result=f.result())

    inner.add_done_callback(done)

