"""The rollout-side contract: token-in/token-out generation with SGLang's semantics.

Field names follow SGLang's `/generate` API (docs/sglang.md) so the SGLang HTTP client
and the embedded engine implement the same protocol and are interchangeable in the loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import operator
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

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

    @classmethod
    def of(cls, value: "SamplingParams | Mapping[str, Any]") -> "SamplingParams":
        """`value` itself when it is a SamplingParams, else a new one built from an SGLang-style
        dict (unknown keys raise ValueError). Never modifies `value`."""
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, Mapping):
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"sampling_params: {e}; use the fields of SamplingParams") from None
        raise ValueError(f"sampling_params must be a SamplingParams (or a dict of its fields), "
                         f"got {type(value).__name__}")

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field's type and range; ValueError names the field and what it accepts.
        With `vocab_size`, stop token ids must lie in the vocabulary too."""
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sampling_params.{name} must be an int, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"sampling_params.{name} must be a finite number, got {value!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        upper = math.inf if vocab_size is None else vocab_size
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < upper for t in self.stop_token_ids):
            where = "ids >= 0" if vocab_size is None else f"ids in [0, {vocab_size})"
            raise ValueError(f"sampling_params.stop_token_ids must be a list of token {where}, "
                             f"got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2 ** 63) <= self.seed < 2 ** 64):
            raise ValueError(f"sampling_params.seed must be None or a 64-bit int, got {self.seed!r}")


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
    # Make the tokens observable while they are generated (`axrl.inference.token_stream`): engines
    # whose progress is local (the embedded one) always are; the SGLang client then streams the
    # request's `/generate` (single requests only; a batch is sent whole).
    stream: bool = False

    def validated(self, *, vocab_size: int | None = None,
                  max_seq_len: int | None = None) -> tuple["GenerateRequest", list[int]]:
        """Check every field; ValueError names the field and what it accepts.

        Returns (request, prompt): the request itself, or — when `sampling_params` was given as a
        dict — a copy holding the parsed `SamplingParams`; this request is never modified. `prompt`
        is `input_ids` as a new list of ints. `vocab_size` bounds token ids, `max_seq_len` the
        prompt's length (an engine's limits; unchecked when None)."""
        sp = SamplingParams.of(self.sampling_params)
        req = self if sp is self.sampling_params else dataclasses.replace(self, sampling_params=sp)
        try:
            prompt = list(map(operator.index, self.input_ids))  # C-level loop: ~3x the comprehension
        except TypeError:
            raise ValueError("input_ids must be a sequence of integer token ids") from None
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if max_seq_len is not None and len(prompt) > max_seq_len:
            raise ValueError(f"input_ids has {len(prompt)} tokens, more than the engine's "
                             f"max_seq_len={max_seq_len}; shorten the prompt or raise max_seq_len")
        upper = math.inf if vocab_size is None else vocab_size
        if min(prompt) < 0 or max(prompt) >= upper:
            bad = next(t for t in prompt if not 0 <= t < upper)
            raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {vocab_size})"
                             if vocab_size is not None else f"input_ids contains negative token id {bad}")
        sp.validate(vocab_size)
        if not isinstance(self.routed_experts_start_len, int) or self.routed_experts_start_len < 0:
            raise ValueError(f"routed_experts_start_len must be an int >= 0, got {self.routed_experts_start_len!r}")
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty string, got {self.rid!r}")
        return req, prompt


def validate_submission(requests: Iterable[Any], *, vocab_size: int | None = None,
                        max_seq_len: int | None = None) -> list[tuple[GenerateRequest, list[int]]]:
    """`GenerateRequest.validated` for each request of one submission, all or nothing, plus the
    checks across them (type, distinct rids). The callers' request objects are left as they are."""
    checked = []
    for req in requests:
        if not isinstance(req, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(req).__name__}")
        checked.append(req.validated(vocab_size=vocab_size, max_seq_len=max_seq_len))
    if len({req.rid for req, _ in checked}) != len(checked):
        raise ValueError("rid: duplicate request ids in one submission; give each request its own rid")
    return checked


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
class ReportsProgress(Protocol):
    """An engine that can say what a request in flight has generated so far (token streaming)."""

    def progress(self, rid: str) -> tuple[list[int], list[float]] | None:
        """The output ids (and logprobs, when requested) of request `rid` so far; None when it is
        not in flight (finished, unknown, or not observable: see `GenerateRequest.stream`)."""
        ...


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
