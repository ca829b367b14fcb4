"""`axrl serve`'s prefill-only `/generate`: teacher-forced prompt logprobs, as SGLang answers them.

A request with `sampling_params.max_new_tokens: 0`, `return_logprob: true` and
`logprob_start_len: s` (≥ 0) generates nothing and reports, per input position from s on,
`[logprob, token_id, null]` (`meta_info.input_token_logprobs`, the first — position s — `[null, id,
null]`, as SGLang reports it) and, with `top_logprobs_num: k`, the k most likely tokens of each
position after s (`input_top_logprobs`, null first). As in
SGLang the values are at temperature 1 whatever `sampling_params.temperature` says, so one client
(`axrl.inference.scoring.sglang.SGLangScorer`) serves both. Scored by the served model, one causal
forward per stream (`axrl.inference.scoring.EmbeddedScorer`), under the weights lock: a weight
update waits for a scoring request and the other way round.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import torch

from axrl.inference.openai.errors import ApiError
from axrl.inference.scoring import EmbeddedScorer
from axrl.inference.serve.state import AxrlServer

__all__ = ["is_prefill_scoring", "score_body"]


def _as_list(value: Any, n: int) -> list[Any]:
    return value if isinstance(value, list) else [value] * n


def is_prefill_scoring(body: Any) -> bool:
    """Whether a /generate body asks for prompt logprobs only (logprob_start_len 0, nothing generated)."""
    if not isinstance(body, dict) or body.get("logprob_start_len") is None:
        return False
    ids = body.get("input_ids")
    n = len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else 1
    sps = _as_list(body.get("sampling_params") or {}, n)
    starts = _as_list(body["logprob_start_len"], n)
    return (all(isinstance(sp, dict) and sp.get("max_new_tokens") == 0 for sp in sps)
            and all(isinstance(s, int) and s >= 0 for s in starts))


def _top(logprobs: torch.Tensor, k: int) -> list[Any]:
    """SGLang's input_top_logprobs for one stream: None for position 0, then k [lp, id, null] rows."""
    vals, idx = logprobs.topk(k, dim=-1)
    return [None] + [[[float(v), int(i), None] for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), idx.tolist())]


def _score_one(server: AxrlServer, ids: list[int], start: int, top_k: int) -> dict[str, Any]:
    model = server.engine.model
    lp = EmbeddedScorer(model).score([ids], 1.0)[0]
    entries = [[None if i == start else float(lp[i]), int(ids[i]), None] for i in range(start, len(ids))]
    meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                            "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                            "weight_version": server.weight_version, "input_token_logprobs": entries,
                            "output_token_logprobs": []}
    if top_k > 0:
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, :-1]
            meta["input_top_logprobs"] = _top(torch.log_softmax(logits[start:].float(), -1).cpu(), top_k)
    return {"text": "", "output_ids": [], "meta_info": meta}


def _check(body: dict[str, Any]) -> tuple[list[list[int]], list[int], bool, int]:
    ids = body.get("input_ids")
    if ids is None:
        raise ApiError(400, "input_ids: prefill-only scoring needs token ids (text is not scored)")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    streams = ids if batched else [ids]
    starts = _as_list(body["logprob_start_len"], len(streams))
    if len(starts) != len(streams):
        raise ApiError(400, f"logprob_start_len: {len(starts)} values for a batch of {len(streams)} requests")
    if not all(_as_list(body.get("return_logprob", False), len(streams))):
        raise ApiError(400, "return_logprob: a prefill-only request (max_new_tokens 0) must ask for logprobs")
    top_k = body.get("top_logprobs_num") or 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ApiError(400, f"top_logprobs_num must be an int >= 0, got {top_k!r}")
    for i, (s, start) in enumerate(zip(streams, starts)):
        if not isinstance(s, list) or not s or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            raise ApiError(400, f"input_ids[{i}]: a non-empty list of token ids")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(s):
            raise ApiError(400, f"logprob_start_len[{i}]: an int in [0, {len(s)}) for a {len(s)}-token prompt, "
                           f"got {start!r}")
    return streams, starts, batched, top_k


async def score_body(server: AxrlServer, body: dict[str, Any]) -> Any:
    """The reply to a prefill-only /generate body (one dict, or a list for a batch)."""
    streams, starts, batched, top_k = _check(body)
    vocab, context = server.engine.config.vocab_size, server.cfg.context_length
    for i, s in enumerate(streams):
        if max(s) >= vocab or min(s) < 0:
            raise ApiError(400, f"input_ids[{i}]: token id outside the model's vocabulary [0, {vocab})")
        if len(s) > context:
            raise ApiError(400, f"input_ids[{i}]: {len(s)} tokens, more than the context length {context}")
    top_k = min(top_k, vocab)
    async with server.weights_lock:
        out = await asyncio.to_thread(lambda: [_score_one(server, s, a, top_k) for s, a in zip(streams, starts)])
    return out if batched else out[0]
