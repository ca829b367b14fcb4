"""vLLM's token-in/token-out wire format: `POST /inference/v1/generate` (vLLM ≥ 0.32, served with
`--enable-scale-out`), request ⇄ `GenerateRequest`, response → `GenerateResult`.

Why this route and not `/v1/completions` (which also takes token-id prompts and, with
`return_token_ids`, returns the sampled ids): it reports per-token `weight_versions` (ranges of
output positions per weight label, as SGLang's), takes our `request_id` (so a request can be
aborted by id on `/abort_requests`; vLLM prefixes it with `generate-tokens-`) and returns logprobs
keyed by token id, with no tokenizer round trip. Both routes sample identically (same engine).

- request: `request_id`, `token_ids`, `sampling_params` {max_tokens, temperature, top_p, top_k,
  seed, stop_token_ids, ignore_eos, logprobs: 0 (the sampled token's own), detokenize: false};
- response: `{request_id, usage, choices: [{token_ids, finish_reason, stop_reason, logprobs:
  {content: [{token_id, logprob}]}, weight_versions, routed_experts}]}`. Logprobs are what the
  server's `--logprobs-mode` says; AxRL launches with `processed_logprobs` (temperature applied,
  top-p/top-k off by default), the semantics of SGLang's and the embedded engine's.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sglang.wire import WireError, parse_weight_version, token_versions

# vLLM's internal id of a /inference/v1/generate request is this prefix + our request_id.
WIRE_ID_PREFIX = "generate-tokens-"


def request_to_vllm(req: GenerateRequest, rid: str) -> dict[str, Any]:
    """The `/inference/v1/generate` body of one request (`rid`: its wire id, e.g. on a retry)."""
    sp = req.sampling_params
    params: dict[str, Any] = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                              "top_k": sp.top_k, "stop_token_ids": list(sp.stop_token_ids),
                              "ignore_eos": sp.ignore_eos, "detokenize": False, "skip_special_tokens": False}
    if sp.seed is not None:
        params["seed"] = sp.seed
    if req.return_logprob:
        params["logprobs"] = 0  # the sampled token's logprob only
    return {"request_id": rid, "token_ids": list(req.input_ids), "sampling_params": params}


def _finish_reason(choice: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    """SGLang-style finish reason: vLLM's string, with the stop token (`stop_reason`, or the EOS
    that ended it) as `matched`."""
    reason = choice.get("finish_reason")
    if reason == "stop":
        matched = choice.get("stop_reason")
        if not isinstance(matched, int):
            matched = output_ids[-1] if output_ids else None
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "abort":
        return {"type": "abort", "message": "aborted on the vLLM server"}
    return {"type": "abort", "message": f"server gave finish_reason {reason!r}"}


def decode_routed_experts(payload: str, req: GenerateRequest, num_output: int) -> np.ndarray:
    """vLLM's `routed_experts` (base64 of a `.npy`, rows for every token but the last) as int32
    `[rows, layers, top_k]` from row `routed_experts_start_len` on (vLLM has no start length).
    `allow_pickle=False`: an array only, never code."""
    rows = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    expected = len(req.input_ids) + num_output - 1
    if rows.ndim != 3 or rows.shape[0] != expected:
        raise WireError(f"choices[0].routed_experts has shape {rows.shape}, expected ({expected}, layers, top_k)")
    return rows[req.routed_experts_start_len:].astype(np.int32)


def result_from_vllm(body: Any, req: GenerateRequest, *, current_version: int) -> GenerateResult:
    """One `/inference/v1/generate` response as a GenerateResult (WireError names a bad field).
    `current_version` stands in where the server's weight label is not an integer ("default")."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise WireError(f"/inference/v1/generate response has no single choice: {str(body)[:200]}")
    choice = choices[0]
    output_ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs: list[float] = []
    if req.return_logprob:
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(output_ids):
            raise WireError(f"choices[0].logprobs.content has {len(content)} entries for {len(output_ids)} "
                            f"token_ids (request {req.rid})")
        for i, entry in enumerate(content):
            if int(entry["token_id"]) != output_ids[i]:
                raise WireError(f"choices[0].logprobs.content[{i}] is for token {entry['token_id']}, token_ids[{i}] "
                                f"is {output_ids[i]} (request {req.rid})")
            logprobs.append(float(entry["logprob"]))
    spans = choice.get("weight_versions") or []
    labels = [parse_weight_version(s.get("version")) for s in spans if isinstance(s, dict)]
    version = labels[-1] if labels and labels[-1] is not None else current_version
    routed = None
    if req.return_routed_experts and choice.get("routed_experts"):
        routed = decode_routed_experts(choice["routed_experts"], req, len(output_ids))
    usage = body.get("usage") or {}
    return GenerateResult(
        rid=req.rid, output_ids=output_ids, output_logprobs=logprobs, routed_experts=routed,
        finish_reason=_finish_reason(choice, output_ids), weight_version=version,
        output_weight_versions=token_versions(spans, len(output_ids), version),
        prompt_tokens=int(usage.get("prompt_tokens") or len(req.input_ids)),
        meta={"cached_tokens": 0, "completion_tokens": len(output_ids), "weight_version": version,
              "request_id": body.get("request_id")})
