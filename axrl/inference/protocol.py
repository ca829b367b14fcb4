"""The rollout-side contract: token-in/token-out generation with SGLang's semantics.

Field names follow SGLang's `/generate` API (docs/sglang.md) so the SGLang HTTP client
and the embedded engine implement the same protocol and are interchangeable in the loop.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, runtime_checkable

import numpy as np


@dataclass
class SamplingParams:
    """SGLang `sampling_params`. temperature 0 means greedy; top_k -1 / top_p 1 disable those filters."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # SGLang's `sampling_seed`: same seed + same logits ⇒ same tokens

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    return_routed_experts: bool = False
    # Rows of routing to skip (multi-turn callers already hold the earlier rows), as in SGLang.
    routed_experts_start_len: int = 0
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Routing hint for multi-server engines: requests with the same key go to the same server, so
    # a trajectory's turns reuse that server's prefix cache. Single-engine implementations ignore it.
    sticky_key: str | None = None


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    # log-softmax(logits / temperature) of each output token, before top-p/top-k (SGLang semantics);
    # empty unless return_logprob.
    output_logprobs: list[float]
    # int32 [prompt + output − 1 − routed_experts_start_len, layers, top_k] or None (SGLang layout):
    # the experts each *input* token was routed to; the last sampled token never went through the model.
    routed_experts: np.ndarray | None
    # {"type": "stop", "matched": id} | {"type": "length", "length": n} | {"type": "abort", "message": str}
    finish_reason: dict[str, Any]
    weight_version: int                 # engine weights version when the request finished
    # Version that generated each output token; differs from weight_version only when weights were
    # updated while the request was running (partial rollouts).
    output_weight_versions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type"))


def settle_future(future: concurrent.futures.Future, result: Any = None,
                  error: BaseException | None = None) -> None:
    """Complete an engine call's future unless its waiter already cancelled it (engines and
    anything that relays their futures settle them this way: a cancel may race the result)."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled concurrently
        pass


@runtime_checkable
class InferenceEngine(Protocol):
    """Async, batched generation. Requests may be submitted at any time (multi-turn agents)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to completion (stop, length or abort)."""
        ...

    def submit_many(self, requests: Iterable[GenerateRequest]) -> list[concurrent.futures.Future]:
        """Submit several requests at once, in this order (admitted together where the engine
        batches); each future resolves to its `GenerateResult`."""
        ...

    def update_weights(self, source: Any, version: int | None = None) -> int:
        """Load new weights (an HF-named state dict or an exported HF directory); return the new
        weight version (`version` if given, else the previous one + 1)."""
        ...

    def abort(self, rid: str) -> bool:
        """Abort a waiting or running request; it finishes with finish_reason type "abort".
        Returns whether the request was found."""
        ...

    def health(self) -> dict[str, Any]:
        """Liveness and load: at least {"ok": bool, "weight_version": int, "running": int, "waiting": int}."""
        ...

    def release_memory(self) -> None:
        """Free the engine's KV cache while it is idle (SGLang: `/release_memory_occupation`), for
        a trainer that shares its device; `resume_memory` before the next request."""
        ...

    def resume_memory(self) -> None:
        """Allocate again what `release_memory` freed (SGLang: `/resume_memory_occupation`)."""
        ...

    @property
    def weight_version(self) -> int:
        ...

    def shutdown(self) -> None:
        """Stop background work; pending requests finish with an abort."""
        ...


@runtime_checkable
class ClockedEngine(InferenceEngine, Protocol):
    """An engine that advances only when told: one `step()` is one scheduler iteration (control
    ops, admission + prefill, one decode step), run in the caller's thread. With the same
    submissions between the same steps it computes the same bits, which is what makes a
    deterministic (count-scheduled) rollout possible; see `axrl.rollout.clock`."""

    clocked: bool  # built to be stepped (no scheduler thread of its own)

    def step(self) -> bool:
        """Run one iteration; False when there was nothing to do (no request, no control op)."""
        ...
