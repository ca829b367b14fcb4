"""How the driver-side handles read a failed actor call: the actor is gone (restart it), or the
call itself raised (re-raise what the actor raised, not Ray's wrapper)."""

from __future__ import annotations

from typing import Any, Callable


def is_dead(ray: Any, error: BaseException) -> bool:
    """The actor died or stopped answering (`runtime.ray.call_timeout_s`)."""
    ex = ray.exceptions
    return isinstance(error, (ex.RayActorError, ex.ActorUnavailableError, ex.GetTimeoutError))


def unwrap(error: Any) -> BaseException:
    """The exception the actor's method raised (a `RayTaskError`'s cause), else `error` itself."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def call_or_restart(ray: Any, current: Callable[[], Any], call: Callable[[Any], Any],
                    restart: Callable[[Any, str], None], what: str, closed: Callable[[], bool] = lambda: False) -> Any:
    """`call(actor)` on the `current()` actor; when that actor is dead (and the caller is not
    `closed()`), `restart(dead_actor, reason)` and call the new one once more."""
    for attempt in (0, 1):
        actor = current()
        try:
            return call(actor)
        except Exception as e:  # noqa: BLE001 — classified just below
            if not is_dead(ray, e) or closed() or attempt:
                raise
            restart(actor, f"{what}: {type(e).__name__}")


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
