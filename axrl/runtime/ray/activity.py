"""What an actor is doing: every actor keeps one `Activity` and reports it with its heartbeat."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator


class Activity:
    """Liveness and activity of one component: state, current work and since when, call count,
    throughput counters, the last error. Thread-safe (read by the monitor while work runs)."""

    def __init__(self, component: str) -> None:
        self.component = component
        self._lock = threading.Lock()
        self._op: str | None = None
        self._since = time.time()
        self._calls = 0
        self._errors = 0
        self._last_error: str | None = None
        self._counters: dict[str, float] = {}
        self._started = time.time()

    @contextmanager
    def doing(self, op: str) -> Iterator[None]:
        with self._lock:
            self._op, self._since = op, time.time()
        try:
            yield
        except BaseException as e:
            with self._lock:
                self._errors += 1
                self._last_error = f"{op}: {type(e).__name__}: {e}"[:300]
            raise
        finally:
            with self._lock:
                self._op, self._since = None, time.time()
                self._calls += 1

    def count(self, key: str, amount: float = 1.0) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def total(self, key: str) -> float:
        """The sum of everything counted under `key` so far."""
        with self._lock:
            return self._counters.get(key, 0.0)

    def report(self) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            up = max(now - self._started, 1e-9)
            return {"component": self.component, "pid": os.getpid(), "state": "busy" if self._op else "idle",
                    "work": self._op, "since_s": round(now - self._since, 3), "heartbeat": now,
                    "calls": self._calls, "errors": self._errors, "last_error": self._last_error,
                    "rates": {k: round(v / up, 3) for k, v in self._counters.items()},
                    "totals": dict(self._counters)}
