"""Sampling for the Tinker API on the run's inference engine, from weight snapshots.

`save_weights_for_sampler` hands the trainer's weights over as a snapshot under a `tinker://` path
(as `axrl train` hands weights to its engine); a sampling session samples from one snapshot. The
engine holds one set of weights at a time: a request for another snapshot waits until the
engine's requests in flight are done, then the engine loads it, so no sequence mixes weights.

Stops: token ids go to the engine (it stops on them); strings are matched on the decoded output
and the tokens are cut after the first one completed. The returned tokens include the stop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from axrl.inference.openai.stops import cut_at_stop
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams
from axrl.inference.scoring import Scorer
from axrl.tinker_api.errors import UserError
from axrl.tinker_api.routing import RoutingMemory
from axrl.tinker_api.wire import Sequence, encode_sample_response

BASE = "base"   # the snapshot of the model directory's own weights
KEEP_EPHEMERAL = 3   # unnamed snapshots (save_weights_and_get_sampling_client) kept in memory


@dataclass
class SampleSpec:
    """A decoded `asample` request."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_ids: list[int] | None      # None: the model's EOS
    stop_strings: list[str]
    prompt_logprobs: bool


@dataclass
class PromptLimits:
    """What a prompt must fit: the model's vocabulary and the sampling engine's context (prompt +
    output; the embedded engine's is `axrl serve --context-length`)."""

    vocab_size: int
    context_length: int | None
    max_position_embeddings: int | None = None

    def check(self, prompt: list[int]) -> None:
        """UserError naming the prompt's first bad token id, or a prompt the context cannot hold."""
        bad = [(i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token {bad[0][0]} = {bad[0][1]} is outside the model's vocabulary "
                            f"[0, {self.vocab_size})")
        if self.context_length is not None and len(prompt) >= self.context_length:
            model = (f"; the model's max_position_embeddings is {self.max_position_embeddings}"
                     if self.max_position_embeddings else "")
            raise UserError(f"prompt has {len(prompt)} tokens, but the sampling engine's context holds "
                            f"{self.context_length} (prompt + output): restart the service with a larger "
                            f"`axrl serve --context-length`{model}")


def parse_stop(stop: Any) -> tuple[list[int] | None, list[str]]:
    """SamplingParams.stop: None (EOS), a string, strings, or token ids ([] disables EOS too)."""
    if stop is None:
        return None, []
    if isinstance(stop, str):
        return None, [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return None, list(stop)
    if isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return list(stop), []
    raise UserError(f"sampling_params.stop must be a string, a list of strings or a list of token ids, got {stop!r}")


class Sampler:
    """The engine, its weight snapshots and the one loaded now; `scorer` gives prompt logprobs
    under the loaded weights (the engine's own model, or its server); with `routing` (an MoE
    model), the routing of every sequence it samples is remembered for the trace."""

    def __init__(self, engine: Any, scorer: Scorer, tokenizer: Any, base_weights: dict[str, torch.Tensor],
                 routing: RoutingMemory | None = None, limits: PromptLimits | None = None) -> None:
        self.engine, self.scorer, self.tokenizer, self.routing = engine, scorer, tokenizer, routing
        self.limits = limits
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {BASE: base_weights}
        self.loaded = BASE
        self.ephemeral: list[str] = []
        self.evicted: set[str] = set()
        self.in_flight = 0
        self.cv = threading.Condition()
        self.version = 0

    def add_snapshot(self, path: str, weights: dict[str, torch.Tensor], ephemeral: bool = False) -> None:
        """Register the weights sampled from under `path` (a copy: later training leaves it as is).
        Of the unnamed (ephemeral) snapshots only the newest `KEEP_EPHEMERAL` stay in memory."""
        with self.cv:
            self.snapshots[path] = {k: v.detach().clone() for k, v in weights.items()}
            if ephemeral:
                self.ephemeral.append(path)
                for old in self.ephemeral[:-KEEP_EPHEMERAL]:
                    if old != self.loaded:
                        self.snapshots.pop(old, None)
                        self.evicted.add(old)
                self.ephemeral = [p for p in self.ephemeral if p in self.snapshots]

    def check(self, path: str) -> None:
        if path in self.evicted:
            raise UserError(f"model_path {path!r}: these unnamed sampler weights were dropped (the server keeps "
                            f"the newest {KEEP_EPHEMERAL}); save_weights_for_sampler with a name keeps them")
        if path not in self.snapshots:
            raise UserError(f"model_path {path!r}: no such sampler weights on this server "
                            "(save_weights_for_sampler returns the paths it has)")

    def _acquire(self, path: str) -> None:
        with self.cv:
            self.check(path)
            while self.loaded != path and self.in_flight:
                self.cv.wait()
            if self.loaded != path:
                self.version += 1
                self.engine.update_weights(self.snapshots[path], self.version)
                self.loaded = path
            self.in_flight += 1

    def _release(self) -> None:
        with self.cv:
            self.in_flight -= 1
            self.cv.notify_all()

    def sample(self, path: str, spec: SampleSpec) -> bytes:
        """Sample `spec` from the snapshot at `path`; the SampleResponse protobuf."""
        requests = [self._request(spec, i) for i in range(spec.num_samples)]
        if self.limits is not None:
            self.limits.check(spec.prompt)
        try:   # the engine's own checks, up front: a bad sampling parameter is the client's mistake
            for request in requests:      # (each: the seeds differ)
                request.validated(vocab_size=None if self.limits is None else self.limits.vocab_size)
        except ValueError as e:
            raise UserError(str(e).replace("input_ids", "prompt")) from None
        self._acquire(path)
        try:
            results = self.engine.generate_batch(requests)
            prompt_lp = self._prompt_logprobs(spec) if spec.prompt_logprobs else None
        finally:
            self._release()
        sequences = [self._sequence(spec, r) for r in results]
        if self.routing is not None:
            for seq, r in zip(sequences, results):
                if r.routed_experts is not None:
                    self.routing.remember(list(spec.prompt) + seq.tokens, r.routed_experts)
        return encode_sample_response(sequences, prompt_lp)

    def _request(self, spec: SampleSpec, i: int) -> GenerateRequest:
        sp = SamplingParams(max_new_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                            top_k=spec.top_k, stop_token_ids=spec.stop_ids or [],
                            ignore_eos=spec.stop_ids is not None,
                            seed=None if spec.seed is None else spec.seed + i)
        return GenerateRequest(input_ids=list(spec.prompt), sampling_params=sp, return_logprob=True,
                               return_routed_experts=self.routing is not None)

    def _sequence(self, spec: SampleSpec, r: GenerateResult) -> Sequence:
        ids, lps = list(r.output_ids), list(r.output_logprobs)
        reason = "stop" if r.finish_type == "stop" else "length"
        if r.finish_type == "abort":
            raise RuntimeError(f"sampling aborted: {r.finish_reason.get('message')}")
        if spec.stop_strings and self.tokenizer is not None:
            cut = cut_at_stop(ids, lambda t: self.tokenizer.decode(t), spec.stop_strings)
            if cut is not None:
                ids, lps, reason = ids[:cut.keep + 1], lps[:cut.keep + 1], "stop"
        return Sequence(tokens=ids, logprobs=lps, stop_reason=reason)

    def _prompt_logprobs(self, spec: SampleSpec) -> np.ndarray:
        """log p(prompt_t | prompt_<t) under the loaded weights (temperature 1); NaN at position 0."""
        return self.scorer.score([spec.prompt], 1.0)[0]
