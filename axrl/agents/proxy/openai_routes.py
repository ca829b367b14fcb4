"""The proxy's OpenAI endpoints: a session's model calls, validated, generated and recorded.

    GET  /sessions/{id}/v1/models, /sessions/{id}/v1/models/{model}
    POST /sessions/{id}/v1/chat/completions     (tools, stream, n, stop, max_tokens, temperature, top_p)
    POST /sessions/{id}/v1/completions

Built on the shared front-end (`axrl.inference.openai`: fields, errors, the stop-string rule,
reply shapes, SSE). Every client error is an `ApiError` with the HTTP status and the offending
field, sent as OpenAI's error object.

- `stream: true`: OpenAI's chunks as the tokens are generated — role, content deltas (text that
  could still become a stop string or a tool call held back), one `tool_calls` delta, finish,
  optional usage, `data: [DONE]`. The requests are submitted with `stream=True` and followed with
  `token_stream.follow` (an engine that cannot report progress gives one chunk at the end); the
  turns are recorded at the end exactly as unstreamed. A client that goes away mid-stream has its
  requests cancelled (aborted in the engine) and nothing recorded, as a cancelled unstreamed call.
- `stop` (up to 4, as OpenAI): the reply is cut right before the first stop string, and only the
  ids before the token that completed it are kept for training.
- `n > 1`: n engine requests sampled together; each choice is a turn (siblings in the session's
  tree — which one the agent continues decides the path).
- Sampling: in a training run the session's sampling is the run's (`rollout.temperature`,
  `top_p`, `top_k`: the trainer's logprobs must be of the distribution that sampled); the
  request's values are checked and only honoured when the session allows it. `max_tokens` is
  honoured up to the session's per-turn limit and the room left in the context.
- `model` may name anything (agents hard-code model names); replies name the proxy's model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from axrl.agents.proxy.registry import SessionPolicy, SessionRegistry
from axrl.agents.proxy.session import Prepared, Session, SessionError
from axrl.inference.openai import replies, schema
from axrl.inference.openai.errors import ApiError, bad
from axrl.inference.openai.http import json_body, json_or_sse
from axrl.inference.openai.stops import cut_at_stop, parse_stops, sendable
from axrl.inference.openai.streaming import Final, Progress, merge, sse_stream
from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sampling import derive_seed
from axrl.inference.token_stream import follow

_IGNORED = frozenset({"logit_bias", "metadata", "store"})  # OpenAI fields SDKs send; no effect here
CHAT_FIELDS = schema.OPENAI_COMMON | schema.OPENAI_CHAT | _IGNORED | {"service_tier", "reasoning_effort", "modalities"}
COMPLETION_FIELDS = schema.OPENAI_COMMON | schema.OPENAI_COMPLETION | _IGNORED
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOPS = 4
Reply = dict[str, Any] | AsyncIterator[bytes]
# The call's ending once every request finished: (choices, each choice's Final, usage); records the turns.
Settle = Callable[[list[GenerateResult]], tuple[list[dict[str, Any]], list[Final], dict[str, Any]]]


def add_openai_routes(app: FastAPI, registry: SessionRegistry) -> None:
    """The per-session OpenAI base URL `/sessions/{id}/v1` on `app`."""

    def authorize(request: Request, session_id: str, calls: bool = False) -> tuple[Session, SessionPolicy]:
        return registry.authorize(session_id, request.headers.get("authorization", ""), calls=calls)

    @app.get("/sessions/{session_id}/v1/models")
    async def models(request: Request, session_id: str) -> dict[str, Any]:
        authorize(request, session_id)
        return {"object": "list", "data": [{"id": registry.model_name, "object": "model", "created": 0,
                                            "owned_by": "axrl"}]}

    @app.get("/sessions/{session_id}/v1/models/{model}")
    async def model(request: Request, session_id: str, model: str) -> dict[str, Any]:
        authorize(request, session_id)
        if model != registry.model_name:
            raise ApiError(404, f"The model {model!r} does not exist; this proxy serves {registry.model_name!r}",
                           param="model", code="model_not_found")
        return {"id": model, "object": "model", "created": 0, "owned_by": "axrl"}

    # The routes of record; `ProxyServer` serves the model calls through `CallRoutes` (same
    # handlers, without FastAPI's middleware and routing on the hot path).
    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_route(request: Request, session_id: str) -> Response:
        session, policy = authorize(request, session_id, calls=True)
        return json_or_sse(await chat(session, policy, await json_body(request), registry.model_name))

    @app.post("/sessions/{session_id}/v1/completions")
    async def completions_route(request: Request, session_id: str) -> Response:
        session, policy = authorize(request, session_id, calls=True)
        return json_or_sse(await completion(session, policy, await json_body(request), registry.model_name))


# ---------------------------------------------------------------------------- endpoints

async def chat(session: Session, policy: SessionPolicy, body: Any, model: str) -> Reply:
    """`POST /v1/chat/completions` in a session."""
    body = _check(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = _chat_messages(body)
    tools = schema.check_tools(body)
    stops = parse_stops(body, limit=MAX_STOPS)
    try:
        prep = session.prepare_chat(messages, tools if policy.render_tools else None)
    except SessionError as e:
        raise ApiError(400, str(e), param="messages") from None
    requests = _requests(session, policy, body, prep, "max_completion_tokens")

    def settle(results: list[GenerateResult]) -> tuple[list[dict[str, Any]], list[Final], dict[str, Any]]:
        choices, finals, kept = [], [], 0
        for k, res in enumerate(results):
            ids, text, finish, matched = _cut(session, res, stops, chat=True)
            content, calls = replies.tool_calls_of(session.tokenizer, tools, text)
            message = replies.assistant_message(content, calls)
            session.record(prep, res, reply=message, text=text, output_ids=ids)
            kept += len(ids)
            reason = replies.finish_reason(finish, tool_calls=bool(calls), abort="stop")
            # matched_stop (as `axrl serve` and SGLang say it): which stop string ended the reply
            choices.append({**replies.chat_choice(k, message, reason), "matched_stop": matched})
            finals.append(Final(content, reason, calls, {"matched_stop": matched}))
        return choices, finals, replies.usage(len(prep.prompt_ids), kept)

    hold_from = replies.tool_call_start(session.tokenizer) if tools else None
    return await _reply(session, replies.Envelope(chat=True, model=model), body, requests, settle,
                        lambda ids: sendable(_text(session, ids, chat=True), stops, hold_from))


async def completion(session: Session, policy: SessionPolicy, body: Any, model: str) -> Reply:
    """`POST /v1/completions` in a session: `prompt` is text or token ids."""
    body = _check(body, COMPLETION_FIELDS, "/v1/completions")
    prompt = body.get("prompt")
    ids = schema.token_ids(prompt, "prompt") if isinstance(prompt, list) else None
    if not isinstance(prompt, str) and ids is None:
        raise bad("prompt", "must be a string or a non-empty list of token ids (one prompt per call)")
    if ids is not None and any(t < 0 or t >= session.tokenizer.vocab_size for t in ids):
        raise bad("prompt", f"token ids must be in [0, {session.tokenizer.vocab_size})")
    if body.get("echo"):
        raise bad("echo", "echoing the prompt is not supported")
    stops = parse_stops(body, limit=MAX_STOPS)
    prep = session.prepare_completion(ids if ids is not None else prompt)
    requests = _requests(session, policy, body, prep, "max_tokens")

    def settle(results: list[GenerateResult]) -> tuple[list[dict[str, Any]], list[Final], dict[str, Any]]:
        finals, kept = [], 0
        for res in results:
            out, text, finish, matched = _cut(session, res, stops, chat=False)
            session.record(prep, res, reply=None, text=text, output_ids=out)
            kept += len(out)
            finals.append(Final(text, replies.finish_reason(finish, tool_calls=False, abort="stop"),
                                extras={"matched_stop": matched}))
        choices = [replies.completion_choice(k, f.content or "", f.finish_reason) for k, f in enumerate(finals)]
        return choices, finals, replies.usage(len(prep.prompt_ids), kept)

    return await _reply(session, replies.Envelope(chat=False, model=model), body, requests, settle,
                        lambda ids: sendable(_text(session, ids, chat=False), stops))


# ---------------------------------------------------------------------------- requests

def _check(body: Any, allowed: frozenset[str], endpoint: str) -> dict[str, Any]:
    body = schema.check_body(body, allowed, endpoint)
    schema.check_model(body, served=None)
    schema.include_usage(body, known=None)
    return body


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as the template renders them: `developer` is `system`, content
    parts are their text."""
    messages = schema.check_messages(body, roles=ROLES)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" and not isinstance(m.get("content"), (str, list)):
            raise bad(f"messages[{i}].content",
                      f"must be a string or a list of content parts, got {m.get('content')!r}")
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    return [{**m, "content": "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))}
            if isinstance(m.get("content"), list) else m for m in messages]


def _requests(session: Session, policy: SessionPolicy, body: dict[str, Any], prep: Prepared,
              max_key: str) -> list[GenerateRequest]:
    """The call's n engine requests: the session's sampling, the request's where it may choose."""
    n = schema.integer(body, "n", 1, MAX_N) or 1
    temperature, top_p = schema.number(body, "temperature", 0.0, 2.0), schema.number(body, "top_p", 1e-6, 1.0)
    requested = schema.integer(body, max_key, 1, 1 << 20) or schema.integer(body, "max_tokens", 1, 1 << 20)
    seed = schema.integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    room = session.max_context_len - len(prep.prompt_ids)
    if room < 1:
        raise ApiError(400, f"messages: the conversation renders to {len(prep.prompt_ids)} tokens; this "
                       f"session's context is {session.max_context_len} tokens", param="messages",
                       code="context_length_exceeded")
    # One `replace` per request (each costs ~10 µs on the proxy's thread, per call).
    fields: dict[str, Any] = {"max_new_tokens": min(requested or policy.max_tokens, policy.max_tokens, room)}
    if policy.honour_sampling:
        fields.update(temperature=policy.sampling.temperature if temperature is None else temperature,
                      top_p=policy.sampling.top_p if top_p is None else top_p)
    base = policy.seed if policy.seed is not None else seed
    out = []
    for j in range(n):
        s = None if base is None else derive_seed(int(base), session.calls * MAX_N + j + 1)
        sp = dataclasses.replace(policy.sampling, **fields, seed=s)
        out.append(GenerateRequest(input_ids=list(prep.prompt_ids), sampling_params=sp,
                                   return_logprob=True, return_routed_experts=bool(session.meta.get("routing")),
                                   routed_experts_start_len=prep.start_len,
                                   rid=f"{session.id}-{session.calls}-{j}-{uuid.uuid4().hex[:8]}",
                                   sticky_key=session.id, stream=bool(body.get("stream"))))
    return out


async def _generate(session: Session, requests: list[GenerateRequest]) -> list[GenerateResult]:
    futures = [asyncio.wrap_future(session.submit(r)) for r in requests]
    try:
        if len(futures) == 1:  # the usual call (n = 1): no gathering future to build and wake
            return [await futures[0]]
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        raise _cancelled() from None


def _cancelled() -> BaseException:
    """What a call raises when its requests were cancelled: the client went away (the task is
    being cancelled: nothing to answer), or the episode was cancelled under the call (the run's
    end, an over-provisioned episode dropped): the agent gets an OpenAI-shaped error, not a
    dropped connection."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.CancelledError()
    return ApiError(503, "the episode was cancelled while this call was being generated", code="episode_cancelled")


async def _follow(session: Session, requests: list[GenerateRequest], text_of: Callable[[list[int]], str],
                  settle: Settle, usage: dict[str, Any]) -> AsyncIterator[list[Progress]]:
    """A streamed call's progress (`sse_stream`): each choice's sendable text as its tokens arrive,
    then every choice's Final once all finished (`settle` records the turns, as unstreamed; it
    fills `usage`). Leaving early (the client went away) cancels the requests still running —
    the engine aborts them — and records nothing, as a cancelled unstreamed call."""
    engine = getattr(session.submit, "engine", None)  # `engine_submit`'s; other submits: no progress
    futures: list[concurrent.futures.Future] = []
    try:
        futures = [session.submit(r) for r in requests]
        results: list[GenerateResult] = [None] * len(requests)  # type: ignore[list-item]
        async for k, snap in merge([follow(engine, r.rid, f) for r, f in zip(requests, futures)]):
            if isinstance(snap, GenerateResult):
                results[k] = snap
            else:
                yield [text_of(snap[0]) if j == k else None for j in range(len(requests))]
        _, finals, totals = settle(results)
        usage.update(totals)
        yield list(finals)
    except asyncio.CancelledError:
        raise _cancelled() from None
    finally:
        for f in futures:
            f.cancel()  # a no-op once it finished


# ---------------------------------------------------------------------------- replies

def _cut(session: Session, res: GenerateResult, stops: list[str],
         chat: bool) -> tuple[list[int], str, str, str | None]:
    """(kept ids, reply text, finish type, the stop string matched): the reply cut at its first
    stop string (finish "stop")."""
    ids = list(res.output_ids)

    def text_of(x: list[int]) -> str:
        return _text(session, x, chat)

    cut = cut_at_stop(ids, text_of, stops)
    if cut is None:
        return ids, text_of(ids), res.finish_type, None
    return ids[:cut.keep], cut.text, "stop", cut.matched


def _text(session: Session, ids: list[int], chat: bool) -> str:
    return replies.reply_text(session.tokenizer, ids, chat=chat, skip_special=False)


async def _reply(session: Session, envelope: replies.Envelope, body: dict[str, Any], requests: list[GenerateRequest],
                 settle: Settle, sendable_text: Callable[[list[int]], str]) -> Reply:
    """The call's reply object once generated, or (`stream`) its chunks as the tokens arrive
    (`sendable_text`: what of a running reply's output ids may be sent)."""
    if not body.get("stream"):
        choices, _, usage = settle(await _generate(session, requests))
        return envelope.reply(choices, usage)
    usage: dict[str, Any] = {}
    wanted = schema.include_usage(body, known=None)
    return sse_stream(envelope, len(requests), _follow(session, requests, sendable_text, settle, usage),
                      (lambda: usage) if wanted else None)
