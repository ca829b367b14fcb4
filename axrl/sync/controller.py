"""WeightSync: the trainer posts each new version of the weights; the rollout worker picks them
up when its schedule says so (`axrl.rollout.schedule`) and loads them into its engine.

The trainer posts a *copy* (so the engine may load it while the trainer already computes the
next step) and only the newest version is kept: an engine that skipped a version goes straight
to the latest. Waiting works from threads and from the worker's event loop alike.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Mapping

import torch


class WeightSync:
    def __init__(self, version: int = 0) -> None:
        self._cv = threading.Condition()
        self._version = version
        self._weights: dict[str, torch.Tensor] | Any = None
        self._listeners: list[Callable[[], None]] = []

    def post(self, version: int, weights: Mapping[str, torch.Tensor] | Any) -> None:
        """Publish `version`: a detached copy of a state dict is taken here; anything else (a
        remote train group's immutable snapshot handle, `TrainBackend.sync_source`) is kept as is."""
        copy = ({name: t.detach().clone() for name, t in weights.items()} if isinstance(weights, Mapping)
                else weights)
        with self._cv:
            if version <= self._version and self._weights is not None:
                raise ValueError(f"weights version {version} posted after version {self._version}")
            self._version, self._weights = version, copy
            listeners = list(self._listeners)
            self._cv.notify_all()
        for notify in listeners:
            notify()

    @property
    def version(self) -> int:
        """The newest posted version."""
        with self._cv:
            return self._version

    def get(self) -> tuple[int, dict[str, torch.Tensor] | Any]:
        """(newest version, its weights — None when nothing was posted since construction)."""
        with self._cv:
            return self._version, self._weights

    def subscribe(self, notify: Callable[[], None]) -> None:
        """Call `notify()` (from the posting thread) after every post."""
        with self._cv:
            self._listeners.append(notify)

    async def wait_for(self, version: int, stop: Callable[[], bool] = lambda: False, poll_s: float = 0.2) -> None:
        """Wait (on an event loop) until `version` or a newer one has been posted, or `stop()`."""
        while self.version < version and not stop():
            await asyncio.to_thread(self._wait, version, poll_s)  # bounded waits: `stop` is checked between

    def _wait(self, version: int, timeout: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._version >= version, timeout)
