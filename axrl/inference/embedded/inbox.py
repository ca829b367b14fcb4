"""What the embedded engine's API threads hand its scheduler thread: requests in flight, control
ops, and the lock-guarded queues between them.

A request enters as a `SequenceState` built by `new_sequence` from an already validated
`GenerateRequest` (see `GenerateRequest.validated`); everything the scheduler needs about it —
prompt, stop ids, output limit, sampler row with its private generator — is fixed here, at
submission, so the schedule never depends on when a request is looked at again.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from axrl.inference.embedded.prefix_cache import CacheMatch
from axrl.inference.protocol import GenerateRequest
from axrl.inference.sampling import RowParams, derive_seed


@dataclass(eq=False)
class SequenceState:
    """One request's state, from submission to its result."""

    req: GenerateRequest
    prompt: list[int]
    stop_ids: frozenset[int]
    limit: int  # most output tokens: max_new_tokens, capped so prompt + output <= max_seq_len
    row: RowParams
    future: concurrent.futures.Future
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted: bool = False
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)  # int32 chunks [rows, layers, top_k]
    cache_match: CacheMatch | None = None  # its prefix in the prefix cache (locked while running)
    cached_tokens: int = 0                 # prompt tokens taken from the prefix cache (SGLang's cached_tokens)

    @property
    def wants_routing(self) -> bool:
        return self.req.return_routed_experts


@dataclass
class ControlOp:
    """An operation the scheduler applies between two iterations (never during a forward)."""

    kind: Literal["abort", "weights", "memory"]
    payload: Any
    future: concurrent.futures.Future | None = None


class Inbox:
    """The hand-over between API threads and the scheduler thread; every field is guarded by `cv`."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.waiting: deque[SequenceState] = deque()
        self.control: deque[ControlOp] = deque()
        self.live: dict[str, SequenceState] = {}
        self.stopping = False
        self.submitted = 0


def new_sequence(req: GenerateRequest, prompt: list[int], *, counter: int, engine_seed: int,
                 eos_token_ids: frozenset[int], max_seq_len: int) -> SequenceState:
    """The in-flight state of a validated request, the `counter`-th the engine has accepted.

    A sampled request (temperature > 0) gets its own generator, seeded from `sampling_params.seed`
    or else derived from (engine seed, counter), so its random stream never depends on the batch."""
    sp = req.sampling_params
    generator = None
    if sp.temperature > 0:
        seed = sp.seed if sp.seed is not None else derive_seed(engine_seed, counter)
        generator = torch.Generator().manual_seed(seed)
    stop = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_token_ids)
    limit = min(sp.max_new_tokens, max_seq_len - len(prompt))
    return SequenceState(req=req, prompt=prompt, stop_ids=stop, limit=limit, future=concurrent.futures.Future(),
                         row=RowParams(sp.temperature, sp.top_k, sp.top_p, generator, req.return_logprob))
