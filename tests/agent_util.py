"""Helpers of the black-box agent tests: an engine whose replies a test scripts, and a tiny real one."""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any, Callable, Iterable

import numpy as np
import torch

from axrl.inference import EmbeddedEngine
from axrl.agents.proxy import SessionPolicy, engine_submit
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams
from axrl.model import build_model, preset_config
from axrl.tokenizer import Tokenizer


class ScriptedEngine:
    """An InferenceEngine whose outputs a test chooses, each token with logprob −0.5, cut at the
    request's max_new_tokens.

    `reply` is either a function `prompt ids -> output ids` (the proxy's stitching, the agents'
    tool use) or a script: a list consumed one entry per request, each a list of output ids or a
    dict {"ids", "type", "versions"} (a finish type, per-token weight versions). The finish reason:
    the entry's "type" when given; else with `eos`, a stop when the (cut) output ends in it and
    "length" otherwise; without, "length" when the reply was cut and a stop on its last token
    otherwise. With `routing`, a request that asks for routing gets row p filled with p + 1 (L × K),
    so a test can check that every token got exactly its own row (and 0 = padding)."""

    L, K = 2, 2

    def __init__(self, reply: Callable[[list[int]], list[int]] | list[Any], eos: int | None = None,
                 version: int = 0, *, routing: bool = False) -> None:
        self.script = None if callable(reply) else list(reply)
        self.reply = reply if callable(reply) else (lambda _prompt: self.script.pop(0))
        self.eos, self.version, self.routing = eos, version, routing
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return self._run(request)

    def submit_many(self, requests: Iterable[GenerateRequest]) -> list[concurrent.futures.Future]:
        out = []
        for r in requests:
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.set_result(self._run(r))
            out.append(f)
        return out

    def _run(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        spec = self.reply(list(request.input_ids))
        spec = spec if isinstance(spec, dict) else {"ids": spec}
        limit = request.sampling_params.max_new_tokens
        full = list(spec["ids"])
        ids = full[:limit]
        kind = spec.get("type") or self._finish(full, ids)
        finish = ({"type": kind, "matched": ids[-1] if self.eos is None else self.eos} if kind == "stop"
                  else {"type": kind, "length": len(ids)})
        versions = spec.get("versions", [self.version] * len(ids))[:len(ids)]
        return GenerateResult(rid=request.rid, output_ids=ids, output_logprobs=[-0.5] * len(ids),
                              routed_experts=self._routing(request, len(ids)), finish_reason=finish,
                              weight_version=self.version, output_weight_versions=versions,
                              prompt_tokens=len(request.input_ids))

    def _finish(self, full: list[int], ids: list[int]) -> str:
        if self.eos is not None:
            return "stop" if ids and ids[-1] == self.eos else "length"
        return "length" if len(full) > len(ids) else "stop"

    def _routing(self, request: GenerateRequest, n_out: int) -> np.ndarray | None:
        if not (self.routing and request.return_routed_experts):
            return None
        pos = np.arange(request.routed_experts_start_len, len(request.input_ids) + n_out - 1)
        return np.broadcast_to((pos + 1)[:, None, None], (len(pos), self.L, self.K)).astype(np.int32)

    def update_weights(self, source: Any, version: int | None = None) -> int:
        self.version = self.version + 1 if version is None else version
        return self.version

    def abort(self, rid: str) -> bool:
        return False

    def health(self) -> dict[str, Any]:
        return {"ok": True, "weight_version": self.version, "running": 0, "waiting": 0}

    def release_memory(self) -> None:  # a scripted engine holds no KV cache
        pass

    def resume_memory(self) -> None:
        pass

    @property
    def weight_version(self) -> int:
        return self.version

    def shutdown(self) -> None:
        pass


def calculator_policy(tok: Tokenizer) -> Callable[[list[int]], list[int]]:
    """A perfect calculator policy: a tool call for the question, then "The answer is N."."""
    def reply(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        if results:
            out = f"The answer is {results[-1]}."
        else:
            expression = re.findall(r"What is (.*?)\?", text)[-1]
            out = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        return tok.encode(out) + [tok.eos_token_id]
    return reply


def tiny_engine(tok: Tokenizer, seed: int = 0) -> EmbeddedEngine:
    """A random-init micro MoE on the default tokenizer, free-running."""
    torch.set_num_threads(1)
    cfg = preset_config("micro-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return EmbeddedEngine(build_model(cfg, seed=seed).eval(), max_batch_size=8, max_seq_len=512,
                          eos_token_id=tok.eos_token_id)


def open_proxy_session(proxy: Any, engine: Any, tok: Tokenizer, **policy: Any) -> tuple[Any, str]:
    """A proxy session over ``engine`` (48-token turns, 512-token context) and its base URL
    (…/sessions/{id}/v1); ``policy`` overrides SessionPolicy fields."""
    sampling = SamplingParams(max_new_tokens=48, stop_token_ids=tok.stop_token_ids)
    session = proxy.open_session(engine_submit(engine), SessionPolicy(sampling, **{"max_tokens": 48, **policy}),
                                 max_context_len=512)
    return session, proxy.base_url(session)
