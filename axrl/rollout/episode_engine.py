"""One episode's view of the inference engine, and what happens to its request at a weight update.

`run_episode` only ever calls `generate`. Under `rollout.partial_rollout: recompute` the rollout
worker aborts the requests in flight when new weights arrive; this handle then resumes the turn
with a *continuation* — the stream so far plus the partial output as the new prompt, the rest of
the token budget — which the engine prefills under the new weights. The two results are spliced
into one, so the agent loop sees a single turn whose tokens each carry the weight version that
generated them. (`continue` needs no help: the engine keeps decoding and reports per-token
versions itself. `drop` is the worker's business: it discards the episode.)
"""

from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable

import numpy as np

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sampling import derive_seed

Submit = Callable[[GenerateRequest], Awaitable[GenerateResult]]


class EpisodeEngine:
    """`generate` for one episode: submits through `submit` (the engine or the clock) and
    splices continuations of requests the worker interrupted (their rids are in `interrupted`)."""

    def __init__(self, sample_id: int, submit: Submit, interrupted: set[str],
                 inflight: dict[str, "EpisodeEngine"]) -> None:
        self.sample_id = sample_id
        self._submit, self._interrupted, self._inflight = submit, interrupted, inflight
        self.continuations = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self._send(request)
        part = 0
        while result.finish_type == "abort" and result.rid in self._interrupted:
            self._interrupted.discard(result.rid)
            part += 1
            done = _finished_reason(request, result)
            if done is not None:  # the interrupted request had in fact reached its end
                return dataclasses.replace(result, finish_reason=done)
            self.continuations += 1
            more = await self._send(continuation(request, result, part))
            result = splice(result, more)
        return result

    async def _send(self, request: GenerateRequest) -> GenerateResult:
        self._inflight[request.rid] = self
        try:
            return await self._submit(request)
        finally:
            self._inflight.pop(request.rid, None)


def _finished_reason(request: GenerateRequest, partial: GenerateResult) -> dict | None:
    sp = request.sampling_params
    out = partial.output_ids
    if out and out[-1] in sp.stop_token_ids:
        return {"type": "stop", "matched": out[-1]}
    if len(out) >= sp.max_new_tokens:
        return {"type": "length", "length": len(out)}
    return None


def continuation(request: GenerateRequest, partial: GenerateResult, part: int) -> GenerateRequest:
    """The request that resumes `request` after `partial` (its interrupted result): the partial
    output appended to the prompt, the remaining token budget, a seed derived from the original
    one and the part number, routing rows from where the held ones stop."""
    sp = request.sampling_params
    held = request.routed_experts_start_len + (0 if partial.routed_experts is None else len(partial.routed_experts))
    return dataclasses.replace(
        request,
        input_ids=list(request.input_ids) + list(partial.output_ids),
        sampling_params=dataclasses.replace(
            sp, max_new_tokens=sp.max_new_tokens - len(partial.output_ids),
            seed=None if sp.seed is None else derive_seed(int(sp.seed), 1_000_000 + part)),
        routed_experts_start_len=held,
        rid=f"{request.rid}+{part}")


def splice(first: GenerateResult, rest: GenerateResult) -> GenerateResult:
    """One result from an interrupted request's partial result and its continuation's."""
    versions = (list(first.output_weight_versions) or [first.weight_version] * len(first.output_ids))
    versions += list(rest.output_weight_versions) or [rest.weight_version] * len(rest.output_ids)
    parts = [r.routed_experts for r in (first, rest) if r.routed_experts is not None]
    routed = np.concatenate(parts) if parts else None  # an abort before any forward holds no rows
    output_ids = list(first.output_ids) + list(rest.output_ids)
    finish = dict(rest.finish_reason)
    if finish.get("type") == "length":
        finish["length"] = len(output_ids)
    return GenerateResult(
        rid=first.rid, output_ids=output_ids,
        output_logprobs=list(first.output_logprobs) + list(rest.output_logprobs),
        routed_experts=routed, finish_reason=finish, weight_version=rest.weight_version,
        output_weight_versions=versions, prompt_tokens=first.prompt_tokens,
        meta={**first.meta, "continuations": int(first.meta.get("continuations", 0)) + 1})
