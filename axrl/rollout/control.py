"""What the loop needs of the rollout side: start and stop it, load its first weights, snapshot
it for a checkpoint (`RolloutControl`), and take sealed batches from it (`BatchSource`).

The in-process `RolloutWorker` and `TrajectoryPool` are them; under `runtime.executor: ray` one
driver-side handle of the rollout actor is both (`axrl/ray_executor/rollout.py`) and its `take`
returns a reference to the batch, not the batch.
"""

from __future__ import annotations

from typing import Any, Protocol


class RolloutControl(Protocol):
    def load_weights(self, source: Any, version: int) -> None:
        """Load weights `version` into the engine before `start`."""

    def start(self, first_step: int, state: dict[str, Any] | None = None) -> None:
        """Start producing batches `first_step`, `first_step + 1`, … (`state`: a checkpoint's `snapshot`)."""

    def snapshot(self, next_step: int) -> dict[str, Any]:
        """The rollout state a checkpoint taken before `next_step` needs (JSON-serialisable)."""

    def stop(self) -> None:
        """Stop producing."""


class BatchSource(Protocol):
    def take(self, step: int, timeout: float | None = None) -> Any:
        """Block until batch `step` is sealed; remove and return it (or a reference to it)."""
