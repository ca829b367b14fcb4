"""Helpers of the black-box agent tests: an engine whose replies a test scripts, and a tiny real one."""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any, Callable, Iterable

import torch

from axrl.inference import EmbeddedEngine
from axrl.agents.proxy import SessionPolicy, engine_submit
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams
from axrl.model import build_model, preset_config
from axrl.tokenizer import Tokenizer


class ScriptedEngine:
    """An InferenceEngine whose output ids are `reply(prompt_ids)`, cut at max_new_tokens, with
    logprob −0.5 each: the proxy's stitching and the agents' tool use, with outputs a test chooses."""

    def __init__(self, reply: Callable[[list[int]], list[int]]) -> None:
        self.reply, self.requests = reply, []
        self._version = 0

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
        ids = list(self.reply(list(request.input_ids)))
        limit = request.sampling_params.max_new_tokens
        finish = {"type": "length", "length": limit} if len(ids) > limit else {"type": "stop", "matched": ids[-1]}
        ids = ids[:limit]
        return GenerateResult(rid=request.rid, output_ids=ids, output_logprobs=[-0.5] * len(ids),
                              routed_experts=None, finish_reason=finish, weight_version=self._version,
                              output_weight_versions=[self._version] * len(ids), prompt_tokens=len(request.input_ids))

    def update_weights(self, source: Any, version: int | None = None) -> int:
        self._version = self._version + 1 if version is None else version
        return self._version

    def abort(self, rid: str) -> bool:
        return False

    def health(self) -> dict[str, Any]:
        return {"ok": True, "weight_version": self._version, "running": 0, "waiting": 0}

    def release_memory(self) -> None:  # a scripted engine holds no KV cache
        pass

    def resume_memory(self) -> None:
        pass

    @property
    def weight_version(self) -> int:
        return self._version

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
