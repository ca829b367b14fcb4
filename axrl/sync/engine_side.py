"""The engine's side of the sync sentinel: what the engine holds, read where it lives.

`EngineSide` is what `SyncSentinel` asks of an engine: per-tensor checksums of the weights it
computes with next to those of the trainer's posted weights in the same layout, and its
teacher-forced scores of the probe sequences. The embedded engine answers directly from its
parameters and its model's forward (`EmbeddedSide`); SGLang and vLLM servers through their
scoring routes and, for checksums, a route of their own (`ServerSide`; docs/engines.md says
which); an engine with no side (`engine_side` returns None) is verified by nothing and the run's
events say so once.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch

from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.quant import rollout_state_dict
from axrl.model import hf_state_dict
from axrl.sync.checksums import ChecksumPair, state_checksums
from axrl.sync.probe import ProbeScore, score_with_model

Weights = Mapping[str, torch.Tensor]


class EngineSide(Protocol):
    """What the sentinel reads from an engine."""

    name: str
    weight_dtype: str
    unavailable: str | None    # why this engine gives no checksums (None: it does, or never could)

    def checksum_pair(self, weights: Weights) -> ChecksumPair | None:
        """The checksums of `weights` (the trainer's posted state) as the engine should hold them,
        and of what it holds, by the same names (None: this engine cannot say)."""

    def score(self, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """The engine's teacher-forced logprobs (and routing) of each sequence."""


class EmbeddedSide:
    """The embedded engine: its model's parameters (the tensors its decoder is repacked from after
    every load) and its model's forward. Reads only, from the rollout thread: the engine thread
    writes parameters only inside `update_weights`, which has returned."""

    name = "embedded"
    unavailable = None

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.weight_dtype = engine.weight_dtype

    def checksum_pair(self, weights: Weights) -> ChecksumPair:
        """See `EngineSide.checksum_pair`: the posted weights rounded to `rollout.weight_dtype`
        (as the engine rounds them at load) against the engine model's parameters, by HF name."""
        return ChecksumPair(state_checksums(rollout_state_dict(weights, self.weight_dtype)),
                            state_checksums(hf_state_dict(self.engine.model)))

    def score(self, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """See `EngineSide.score`."""
        return score_with_model(self.engine.model, sequences)


class ServerSide:
    """SGLang and vLLM servers (`SGLangEngine`, `VLLMEngine`): the probe re-scored on every server
    through its teacher-forced scoring route (`axrl.inference.scoring`: SGLang's prefill-only
    `/generate`, vLLM's `/v1/completions` with `prompt_logprobs`), the worst server's scores
    compared; checksums through `read_checksums` (engine-specific, below), each server's compared
    and the first server that differs reported."""

    weight_dtype = "fp32"   # servers load the exported fp32/bf16 directory as it is

    def __init__(self, engine: Any, kind: str, vocab_size: int,
                 read_checksums: Callable[[Any, int, Weights], ChecksumPair] | None = None) -> None:
        from axrl.inference.scoring.by_engine import server_scorer

        self.name, self.engine, self.read = kind, engine, read_checksums
        self.scorers = [server_scorer(kind, url, vocab_size) for url in engine.urls]
        self.unavailable: str | None = None if read_checksums else f"{kind}: no checksum route"

    def checksum_pair(self, weights: Weights) -> ChecksumPair | None:
        """See `EngineSide.checksum_pair`; None (the probe decides) once a server could not answer."""
        if self.read is None or self.unavailable is not None:
            return None
        pairs = []
        for server in range(len(self.engine.urls)):
            try:
                pairs.append(self.read(self.engine, server, weights))
            except RuntimeError as e:          # a server without the route: the probe covers it
                self.unavailable = str(e)
                return None
        return next((p for p in pairs if any(getattr(p.held.get(k), "digest", None) != v.digest
                                             for k, v in p.expected.items())), pairs[0])

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
    if module.startswith("axrl.inference.vllm."):
        from axrl.inference.vllm.checksums import vllm_checksum_pair

        return ServerSide(engine, "vllm", vocab_size, vllm_checksum_pair)
    if module.startswith("axrl.inference.sglang."):
        from axrl.inference.sglang.checksums import sglang_checksum_pair

        return ServerSide(engine, "sglang", vocab_size, sglang_checksum_pair)
    return None
