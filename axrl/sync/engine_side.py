"""The engine's side of the sync sentinel: what the engine holds, read where it lives.

`EngineSide` is what `SyncSentinel` asks of an engine: the per-tensor checksums of the weights it
computes with, and its teacher-forced scores of the probe sequences. The embedded engine answers
directly from its parameters and its model's forward (`EmbeddedSide`); SGLang and vLLM servers
through their scoring routes, probe only (`ServerSide`); an engine with no side (`engine_side`
returns None) is verified by nothing and the run's events say so once.
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

    def checksums(self) -> dict[str, TensorChecksum] | None:
        """Per-tensor checksums of the weights the engine holds, by HF name (None: it cannot say)."""

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


class ServerSide:
    """SGLang and vLLM servers (`SGLangEngine`, `VLLMEngine`): no checksums (their weights live in
    the server's worker, in the kernels' own layouts), the probe re-scored on every server through
    its teacher-forced scoring route (`axrl.inference.scoring`: SGLang's prefill-only `/generate`,
    vLLM's `/v1/completions` with `prompt_logprobs`); the worst server's scores are compared."""

    weight_dtype = "fp32"   # not used: no checksums

    def __init__(self, engine: Any, kind: str, vocab_size: int) -> None:
        from axrl.inference.scoring.by_engine import server_scorer

        self.name = kind
        self.scorers = [server_scorer(kind, url, vocab_size) for url in engine.urls]

    def checksums(self) -> None:
        """Servers cannot say (see the class docstring)."""
        return None

    def score(self, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """Each server's logprobs; those of the server farthest from the first (or the first)."""
        scored = [[np.asarray(lp, np.float64) for lp in s.score(list(map(list, sequences)), 1.0)]
                  for s in self.scorers]
        gap = [max(float(np.nanmax(np.abs(a - b), initial=0.0)) for a, b in zip(server, scored[0]))
               for server in scored]
        return [ProbeScore(lp, None) for lp in scored[int(np.argmax(gap))]]


def engine_side(engine: Any, vocab_size: int) -> EngineSide | None:
    """The sentinel's view of `engine`, or None for an engine it cannot read."""
    if isinstance(engine, EmbeddedEngine):
        return EmbeddedSide(engine)
    module = type(engine).__module__
    for kind in ("vllm", "sglang"):
        if module.startswith(f"axrl.inference.{kind}."):
            return ServerSide(engine, kind, vocab_size)
    return None
