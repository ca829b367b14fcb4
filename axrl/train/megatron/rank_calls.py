"""Typed calls to the Megatron ranks: a `MegatronRank` method and its arguments, checked where
the call is made, run the same way on every transport (in-process, worker processes, Ray actors).

The caller names the method itself (`group.call(MegatronRank.optimizer_step, slot, lr, …)`), so a
typo fails at import or lint time and a changed signature fails in the driver, before anything
is sent: `RankCall.of` binds the arguments against the method's signature. What travels is a
`RankCall` (the method's qualified name, its arguments); the rank resolves the name in
`RANK_METHODS`, the fixed registry of `MegatronRank`'s public methods, never by looking an
arbitrary attribute up on itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from axrl.train.megatron.rank import MegatronRank

#: qualified name → function: the methods a driver may run on a rank (public, defined on the class).
RANK_METHODS: dict[str, Callable[..., Any]] = {
    fn.__qualname__: fn for name, fn in vars(MegatronRank).items()
    if inspect.isfunction(fn) and not name.startswith("_")}


@lru_cache(maxsize=None)
def _signature(qualname: str) -> inspect.Signature:
    return inspect.signature(RANK_METHODS[qualname])


def _registered(fn: Callable[..., Any]) -> str:
    """`fn`'s registry key; TypeError when it is not one of the registered rank methods."""
    key = getattr(fn, "__qualname__", None)
    if key is None or RANK_METHODS.get(key) is not fn:
        raise TypeError(f"{fn!r} is not a public MegatronRank method; a rank runs only these: "
                        f"{sorted(k.rpartition('.')[2] for k in RANK_METHODS)}")
    return key


@dataclass(frozen=True)
class RankCall:
    """One checked call of a `MegatronRank` method: `method` (its qualified name), the arguments
    after `self`, and — for `call_each` — whether the rank's own first argument is sent beside it."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    takes_first: bool = False

    @classmethod
    def of(cls, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RankCall:
        """`fn(rank, *args, **kwargs)`, its arguments bound against `fn`'s signature now (TypeError
        naming the method when they do not fit)."""
        key = _registered(fn)
        _bind(key, args, kwargs)
        return cls(key, args, kwargs)

    @classmethod
    def each(cls, fn: Callable[..., Any], first: Any, *args: Any, **kwargs: Any) -> RankCall:
        """`fn(rank, first_r, *args, **kwargs)` with each rank's own `first_r` sent beside the call;
        checked with `first` (any rank's) in its place."""
        key = _registered(fn)
        _bind(key, (first, *args), kwargs)
        return cls(key, args, kwargs, takes_first=True)

    @property
    def name(self) -> str:
        """The method's own name (what a rank's activity and error messages show)."""
        return self.method.rpartition(".")[2]

    def run(self, rank: MegatronRank, *first: Any) -> Any:
        """Run the call on `rank` (with its own first argument when `takes_first`)."""
        fn = RANK_METHODS.get(self.method)
        if fn is None:
            raise TypeError(f"{self.method!r} is not a registered MegatronRank method")
        if len(first) != int(self.takes_first):
            raise TypeError(f"{self.method}: {'one first argument' if self.takes_first else 'no first argument'} "
                            f"expected beside the call, got {len(first)}")
        return fn(rank, *first, *self.args, **self.kwargs)


def _bind(key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        _signature(key).bind(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{key}: {e}") from None


__all__ = ["RANK_METHODS", "RankCall"]
