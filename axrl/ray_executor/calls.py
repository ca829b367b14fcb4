"""How the driver-side handles read a failed actor call: the actor is gone (restart it), or the
call itself raised (re-raise what the actor raised, not Ray's wrapper).

`RestartableActor` is the restart policy the rollout and engine handles share: the current
actor, a budget of restarts, the events that tell the story, and a new actor in the dead one's
place (brought up to date by the handle's own `resume`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable


def is_dead(ray: Any, error: BaseException) -> bool:
    """The actor died or stopped answering (`runtime.ray.call_timeout_s`)."""
    ex = ray.exceptions
    return isinstance(error, (ex.RayActorError, ex.ActorUnavailableError, ex.GetTimeoutError))


def unwrap(error: Any) -> BaseException:
    """The exception the actor's method raised (a `RayTaskError`'s cause), else `error` itself."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


class RestartingHandle:
    """A driver-side handle over a `RestartableActor` (`self._remote`): the current actor's pid
    and how often it was restarted."""

    _remote: "RestartableActor"

    @property
    def pid(self) -> int:
        """The current actor's process id."""
        return self._remote.pid

    @property
    def restarts(self) -> int:
        """How often the actor was restarted so far."""
        return self._remote.restarts


class RestartableActor:
    """One actor behind a driver-side handle, replaced when it dies, at most `budget` times.

    `make_actor()` starts an actor; `get(ref)` is the handle's own way of reading an answer (its
    timeout, its unwrapping). After a restart `resume(actor)` brings the new actor to where the
    dead one was (weights, requests, schedule) and returns the fields the `actor_restarted` event
    adds about it. Past the budget the `actor_failed` event is recorded and `lost` is raised,
    naming the config `key` that sets the budget. `lock` guards the swap (the handle's own lock,
    when resuming must not interleave with its other state changes)."""

    def __init__(self, ray: Any, make_actor: Callable[[], Any], *, get: Callable[[Any], Any],
                 resume: Callable[[Any], dict[str, Any]], events: Any, component: str, name: str, budget: int,
                 key: str, lost: type[RuntimeError], lock: threading.RLock | None = None) -> None:
        self._ray, self._make_actor, self._get, self._resume = ray, make_actor, get, resume
        self._events, self._component, self._name = events, component, name
        self._budget, self._key, self._lost = budget, key, lost
        self._lock = lock or threading.RLock()
        self.restarts = 0
        self.actor = make_actor()
        self.pid: int = get(self.actor.pid.remote())

    def call(self, remote: Callable[[Any], Any], what: str, closed: Callable[[], bool] = lambda: False) -> Any:
        """The answer to `remote(actor)` (a call it starts on the current actor); when that actor
        is dead (and the handle not `closed()`), restart it and call the new one once more.
        `what` names the call in the restart's reason."""
        for attempt in (0, 1):
            actor = self.actor
            try:
                return self._get(remote(actor))
            except Exception as e:  # noqa: BLE001 — classified just below
                if not is_dead(self._ray, e) or closed() or attempt:
                    raise
                self.restart(actor, f"{what}: {type(e).__name__}")
        raise AssertionError("unreachable: the second attempt returns or raises")

    def restart(self, dead: Any, reason: str) -> None:
        """Replace `dead` (unless another thread already did) with a new, resumed actor."""
        with self._lock:
            if dead is not self.actor:
                return
            if self.restarts >= self._budget:
                self._events.record("actor_failed", component=self._component, pid=self.pid, reason=reason,
                                    restarts=self.restarts)
                raise self._lost(f"the {self._name} died again ({reason}) after {self.restarts} restart(s) "
                                 f"({self._key}={self._budget}); the run stops")
            self.restarts += 1
            close_actor(self._ray, dead, ask=False)
            old_pid = self.pid
            self.actor = self._make_actor()
            self.pid = self._get(self.actor.pid.remote())
            fields = self._resume(self.actor)
            self._events.record("actor_restarted", component=self._component, reason=reason, old_pid=old_pid,
                                new_pid=self.pid, **fields, restart=self.restarts)


def close_actor(ray: Any, actor: Any, *, ask: bool = True, timeout_s: float = 30.0) -> Any:
    """Ask `actor` to close (`ask`) and return its answer (None when it is dead), then kill it."""
    answer = None
    if ask:
        try:
            answer = ray.get(actor.close.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 — a dead actor has nothing left to release or report
            pass
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 — already gone
        pass
    return answer
