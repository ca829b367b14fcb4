"""The engine's side of the sync sentinel: what the engine holds, read where it lives.

`EngineSide` is what `SyncSentinel` asks of an engine: the per-tensor checksums of the weights it
computes with, and its teacher-forced scores of the probe sequences. The embedded engine answers
directly from its parameters and its model's forward (`EmbeddedSide`); an engine with no side
(`engine_side` returns None) is verified by nothing and the sentinel says so once.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from axrl.inference.embedded import EmbeddedEngine
from axrl.model import hf_state_dict
from axrl.sync.checksums import TensorChecksum, state_checksums
from axrl.sync.probe import ProbeScore, score_with_model


class EngineSide(Protocol):
    """What the sentinel reads from an engine."""

    name: str
    weight_dtype: str

    def checksums(self) -> dict[str, TensorChecksum]:
        """Per-tensor checksums of the weights the engine holds, by HF name."""

    def score(self, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """The engine's teacher-forced logprobs (and routing) of each sequence."""


class EmbeddedSide:
    """The embedded engine: its model's parameters (the tensors its decoder is repacked from after
    every load) and its model's forward. Reads only, from the rollout thread: the engine thread
    writes parameters only inside `update_weights`, which has returned."""

    name = "embedded"

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.weight_dtype = engine.weight_dtype

    def checksums(self) -> dict[str, TensorChecksum]:
        """See `EngineSide.checksums`."""
        return state_checksums(hf_state_dict(self.engine.model))

    def score(self, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """See `EngineSide.score`."""
        return score_with_model(self.engine.model, sequences)


def engine_side(engine: Any) -> EngineSide | None:
    """The sentinel's view of `engine`, or None for an engine it cannot read."""
    if isinstance(engine, EmbeddedEngine):
        return EmbeddedSide(engine)
    side = getattr(engine, "sentinel_side", None)   # server engines that expose one (docs/engines.md)
    return side() if callable(side) else None
