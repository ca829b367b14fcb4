"""How the driver-side handles read a failed actor call: the actor is gone (restart it), or the
call itself raised (re-raise what the actor raised, not Ray's wrapper)."""

from __future__ import annotations

from typing import Any


def is_dead(ray: Any, error: BaseException) -> bool:
    """The actor died or stopped answering (`runtime.ray.call_timeout_s`)."""
    ex = ray.exceptions
    return isinstance(error, (ex.RayActorError, ex.ActorUnavailableError, ex.GetTimeoutError))


def unwrap(error: Any) -> BaseException:
    """The exception the actor's method raised (a `RayTaskError`'s cause), else `error` itself."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
