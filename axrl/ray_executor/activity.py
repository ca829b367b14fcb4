"""What an actor is doing: every actor keeps one `Activity` and reports it with its heartbeat.

`ActorBase` is what every actor class of `runtime.executor: ray` answers the driver about itself
(pid, node, heartbeat rows); `reported` runs a method under the actor's `Activity`.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar


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


class ActorBase:
    """Mixin of every actor class: its process, its node and its heartbeat. A subclass keeps its
    `Activity` in `self.activity_` (set by its constructor) and extends `activity()` with what it
    adds to its row or the rows of the actors it runs."""

    activity_: Activity

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def activity(self) -> list[dict[str, Any]]:
        """This actor's heartbeat row, first; an actor that runs others appends their rows."""
        return [self.activity_.report()]


Method = TypeVar("Method", bound=Callable[..., Any])


def reported(method: Method) -> Method:
    """Run an `ActorBase` method under the actor's `Activity`, as work named after the method
    (so the monitor sees the actor busy with it, and its errors are counted)."""

    @functools.wraps(method)
    def run(self: ActorBase, *args: Any, **kwargs: Any) -> Any:
        with self.activity_.doing(method.__name__):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


def free_address() -> tuple[str, int]:
    """(this node's address, a port free on it now): where rank 0 offers its process group."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])
