"""The OpenAI side of the recording proxy: request validation, engine requests, response shapes.

Independent of the HTTP framework: `chat` / `completion` take a parsed JSON body and a `Session`
and return the response object (or its SSE chunks). Every client error is a `ProxyError` with
the HTTP status and the offending field, turned into OpenAI's error object by the app.

- `stream: true`: the turn is generated first (any InferenceEngine: the protocol has no token
  stream), then sent as OpenAI's chunks — role, content, one `tool_calls` delta, finish, optional
  usage, `data: [DONE]`.
- `stop`: the engine stops on token ids only; the reply is cut right before the first stop
  string, and only the ids before the token that completed it are kept for training.
- `n > 1`: n engine requests sampled together; each choice is a turn (siblings in the session's
  tree — which one the agent continues decides the path).
- Sampling: in a training run the session's sampling is the run's (`rollout.temperature`,
  `top_p`, `top_k`: the trainer's logprobs must be of the distribution that sampled); the
  request's values are checked and only honoured when the session allows it. `max_tokens` is
  honoured up to the session's per-turn limit and the room left in the context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from axrl.agents.proxy.session import Prepared, Session, SessionError
from axrl.inference.openai_compat import tool_calls_of
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams
from axrl.inference.sampling import derive_seed

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user",
           "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "metadata", "store"}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                         "top_logprobs", "response_format", "service_tier", "reasoning_effort", "modalities"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_N = 16


class ProxyError(Exception):
    """An OpenAI-shaped client error: HTTP `status`, `param` (the field), OpenAI `type`/`code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "invalid_request_error", 429: "rate_limit_error"}.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad(field: str, message: str) -> ProxyError:
    return ProxyError(400, f"{field}: {message}", param=field)


@dataclasses.dataclass
class SessionPolicy:
    """What a session lets a request choose."""

    sampling: SamplingParams            # defaults (a training run: the run's sampling)
    honour_sampling: bool = True        # temperature / top_p from the request (off in training)
    max_tokens: int = 256               # per-turn cap
    seed: int | None = None             # base of per-call seeds (training: the sample's seed)
    render_tools: bool = True           # False: parse tool calls but keep the schema out of the prompt


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(key, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(key, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _check(body: Any, allowed: set[str], endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProxyError(400, f"the {endpoint} body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unknown {endpoint} field")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", f"must be a string, got {body['model']!r}")
    return body


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of up to 4, got {stop!r}")
    return stops


def _requests(session: Session, policy: SessionPolicy, body: dict[str, Any], prep: Prepared,
              max_key: str) -> list[GenerateRequest]:
    n = _int(body, "n", 1, MAX_N) or 1
    temperature, top_p = _number(body, "temperature", 0.0, 2.0), _number(body, "top_p", 1e-6, 1.0)
    requested = _int(body, max_key, 1, 1 << 20) or _int(body, "max_tokens", 1, 1 << 20)
    seed = _int(body, "seed", -(1 << 63), (1 << 63) - 1)
    room = session.max_context_len - len(prep.prompt_ids)
    if room < 1:
        raise ProxyError(400, f"messages: the conversation renders to {len(prep.prompt_ids)} tokens; this "
                         f"session's context is {session.max_context_len} tokens", param="messages",
                         code="context_length_exceeded")
    sp = dataclasses.replace(policy.sampling, max_new_tokens=min(requested or policy.max_tokens,
                                                                 policy.max_tokens, room))
    if policy.honour_sampling:
        sp = dataclasses.replace(sp, temperature=sp.temperature if temperature is None else temperature,
                                 top_p=sp.top_p if top_p is None else top_p)
    base = policy.seed if policy.seed is not None else seed
    out = []
    for j in range(n):
        s = None if base is None else derive_seed(int(base), session.calls * MAX_N + j + 1)
        out.append(GenerateRequest(input_ids=list(prep.prompt_ids), sampling_params=dataclasses.replace(sp, seed=s),
                                   return_logprob=True, return_routed_experts=bool(session.meta.get("routing")),
                                   routed_experts_start_len=prep.start_len,
                                   rid=f"{session.id}-{session.calls}-{j}-{uuid.uuid4().hex[:8]}",
                                   sticky_key=session.id))
    return out


async def _generate(session: Session, requests: list[GenerateRequest]) -> list[GenerateResult]:
    futures = [asyncio.wrap_future(session.submit(r)) for r in requests]
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the client went away: nothing to answer
        # The episode was cancelled under the call (the run's end, an over-provisioned episode
        # dropped): the agent gets an OpenAI-shaped error, not a dropped connection.
        raise ProxyError(503, "the episode was cancelled while this call was being generated",
                         code="episode_cancelled") from None


def _cut(session: Session, res: GenerateResult, stops: list[str], chat: bool) -> tuple[list[int], str, str | None]:
    """(kept ids, reply text, matched stop): the reply cut right before its first stop string."""
    tok = session.tokenizer
    ids = list(res.output_ids)

    def text_of(x: list[int]) -> str:
        if chat and x and x[-1] in tok.stop_token_ids:
            x = x[:-1]
        return tok.decode(x)

    text = text_of(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return ids, text, None
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text_of(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    pos, matched = min(hits)
    return ids[: lo - 1], text[:pos], matched


def _usage(prep: Prepared, kept: list[list[int]]) -> dict[str, int]:
    completion = sum(len(k) for k in kept)
    return {"prompt_tokens": len(prep.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prep.prompt_ids) + completion}


def _finish(res: GenerateResult, matched: str | None, calls: bool) -> str:
    if matched is not None:
        return "stop"
    if res.finish_type == "stop":
        return "tool_calls" if calls else "stop"
    return "length" if res.finish_type == "length" else "stop"


async def chat(session: Session, policy: SessionPolicy, body: Any, model: str) -> dict[str, Any] | AsyncIterator[bytes]:
    """`POST /v1/chat/completions` in a session."""
    body = _check(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of {role, content} messages is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}]", "must be an object with role system|developer|user|assistant|tool")
        if m.get("role") != "assistant" and not isinstance(m.get("content"), (str, list)):
            raise bad(f"messages[{i}].content", f"must be a string or a list of content parts, got {m.get('content')!r}")
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    messages = [{**m, "content": "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))}
                if isinstance(m.get("content"), list) else m for m in messages]
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("tools", "must be a list of tool definitions")
    if body.get("tool_choice") not in (None, "auto", "none", "required") and not isinstance(body.get("tool_choice"), dict):
        raise bad("tool_choice", f"must be 'auto', 'none', 'required' or an object, got {body['tool_choice']!r}")
    stops = _stops(body)
    try:
        prep = session.prepare_chat(messages, tools if policy.render_tools else None)
    except SessionError as e:
        raise ProxyError(400, str(e), param="messages") from None
    requests = _requests(session, policy, body, prep, "max_completion_tokens")
    results = await _generate(session, requests)
    choices, kept = [], []
    for k, res in enumerate(results):
        ids, text, matched = _cut(session, res, stops, chat=True)
        content, calls = tool_calls_of(session.tokenizer, tools, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        session.record(prep, res, reply=message, text=text, output_ids=ids)
        kept.append(ids)
        choices.append({"index": k, "message": message, "logprobs": None,
                        "finish_reason": _finish(res, matched, bool(calls))})
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    usage = _usage(prep, kept)
    if body.get("stream"):
        return _chat_stream(head, choices, usage if (body.get("stream_options") or {}).get("include_usage") else None)
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage}


async def completion(session: Session, policy: SessionPolicy, body: Any, model: str) -> dict[str, Any] | AsyncIterator[bytes]:
    """`POST /v1/completions` in a session: `prompt` is text or token ids."""
    body = _check(body, COMPLETION_FIELDS, "/v1/completions")
    prompt = body.get("prompt")
    ids = prompt if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt) else None
    if not isinstance(prompt, str) and ids is None:
        raise bad("prompt", "must be a string or a non-empty list of token ids (one prompt per call)")
    if ids is not None and any(t < 0 or t >= session.tokenizer.vocab_size for t in ids):
        raise bad("prompt", f"token ids must be in [0, {session.tokenizer.vocab_size})")
    if body.get("echo"):
        raise bad("echo", "echoing the prompt is not supported")
    stops = _stops(body)
    prep = session.prepare_completion(ids if ids is not None else prompt)
    requests = _requests(session, policy, body, prep, "max_tokens")
    results = await _generate(session, requests)
    choices, kept = [], []
    for k, res in enumerate(results):
        out, text, matched = _cut(session, res, stops, chat=False)
        session.record(prep, res, reply=None, text=text, output_ids=out)
        kept.append(out)
        choices.append({"index": k, "text": text, "logprobs": None, "finish_reason": _finish(res, matched, False)})
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    usage = _usage(prep, kept)
    if body.get("stream"):
        return _completion_stream(head, choices, usage if (body.get("stream_options") or {}).get("include_usage") else None)
    return {**head, "object": "text_completion", "choices": choices, "usage": usage}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _chat_stream(head: dict[str, Any], choices: list[dict[str, Any]],
                       usage: dict[str, int] | None) -> AsyncIterator[bytes]:
    h = {**head, "object": "chat.completion.chunk"}
    for c in choices:
        k, msg = c["index"], c["message"]
        yield _sse({**h, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]})
        if msg.get("content"):
            yield _sse({**h, "choices": [{"index": k, "delta": {"content": msg["content"]}, "logprobs": None,
                                          "finish_reason": None}]})
        if msg.get("tool_calls"):
            yield _sse({**h, "choices": [{"index": k, "delta": {"tool_calls": [
                {"index": i, **call} for i, call in enumerate(msg["tool_calls"])]}, "logprobs": None,
                "finish_reason": None}]})
        yield _sse({**h, "choices": [{"index": k, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}]})
    if usage is not None:
        yield _sse({**h, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


async def _completion_stream(head: dict[str, Any], choices: list[dict[str, Any]],
                             usage: dict[str, int] | None) -> AsyncIterator[bytes]:
    h = {**head, "object": "text_completion"}
    for c in choices:
        yield _sse({**h, "choices": [{"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": None}]})
        yield _sse({**h, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                      "finish_reason": c["finish_reason"]}]})
    if usage is not None:
        yield _sse({**h, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"
