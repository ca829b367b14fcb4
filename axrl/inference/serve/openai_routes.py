"""OpenAI `/v1/completions` and `/v1/chat/completions` of `axrl serve` (black-box agents).

Prompts may be text, chat messages or token ids (`prompt` as ids; chat `input_ids`, as SGLang
accepts). Token-level data comes back the SGLang way: `return_token_ids` adds
`prompt_token_ids` / `response_token_ids` to each choice, `return_meta_info` adds the engine's
`meta_info` (logprobs with token ids, routed experts, weight_version). Chat replies are parsed
for the template's tool-call blocks into OpenAI `tool_calls` when the request declares `tools`, and
the family's reasoning (`<think>…</think>`, harmony's analysis channel) goes to
`message.reasoning_content` (streamed as `delta.reasoning_content`), as vLLM and SGLang return it.

- `model` must be the served name (`GET /v1/models`); another one is a 404, as OpenAI answers.
- `n` choices are `n` requests admitted together (choice j samples with seed `derive_seed(seed, j)`
  for j ≥ 1, so choice 0 of a seeded request is the `n = 1` reply); at most the engine's slots.
- `stop` (a string or a list): the server watches the decoded text as tokens arrive, aborts the
  request at the first stop string and cuts the reply (text, token ids, logprobs) by the rule of
  `axrl.inference.openai.stops` — the same cut whenever the abort lands.
- `stream`: OpenAI's SSE chunks (`axrl.inference.openai.streaming`) as tokens arrive; text is
  held back while it could still turn into a stop string or a tool call.

Errors are SGLang's flat error object, as for the rest of `axrl serve`.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from axrl.inference.openai import replies, schema
from axrl.inference.openai.errors import ApiError, bad
from axrl.inference.openai.http import json_body, json_or_sse
from axrl.inference.openai.stops import cut_at_stop, first_stop, parse_stops, sendable
from axrl.inference.openai.streaming import Final, Progress, Reasoned, sse_stream
from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sampling import derive_seed
from axrl.inference.serve.state import AxrlServer
from axrl.inference.sglang.wire import sampling_from_wire

_COMPLETION_FIELDS = schema.OPENAI_COMMON | schema.SGLANG_COMMON | schema.OPENAI_COMPLETION
_CHAT_FIELDS = schema.OPENAI_COMMON | schema.SGLANG_COMMON | schema.OPENAI_CHAT | schema.SGLANG_CHAT
# OpenAI sampling field -> SGLang sampling_params field (validated by the SGLang parser)
_SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
             ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"), ("min_p", "min_p"),
             ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
             ("repetition_penalty", "repetition_penalty"))
Reply = dict[str, Any] | AsyncIterator[bytes]


@dataclasses.dataclass
class _Call:
    """One OpenAI request: its engine requests (n per prompt) and how to render their text."""

    server: AxrlServer
    body: dict[str, Any]
    requests: list[GenerateRequest]
    stops: list[str]
    chat: bool
    skip_special: bool
    envelope: replies.Envelope

    def text(self, ids: list[int]) -> str:
        return replies.reply_text(self.server.tokenizer, ids, chat=self.chat, skip_special=self.skip_special)

    @property
    def tool_start(self) -> str | None:
        """The tool-call opening tag streaming holds back (chat with `tools` only)."""
        tok = self.server.tokenizer
        return replies.tool_call_start(tok) if self.chat and self.body.get("tools") and tok is not None else None


def add_openai_routes(app: FastAPI, server: AxrlServer) -> None:
    """`POST /v1/completions` and `POST /v1/chat/completions` of `server` on `app`."""

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Response:
        return json_or_sse(await completions(server, await json_body(request), request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions_route(request: Request) -> Response:
        return json_or_sse(await chat_completions(server, await json_body(request), request.is_disconnected))


# ---------------------------------------------------------------------------- requests

async def completions(server: AxrlServer, body: Any, is_disconnected: Any) -> Reply:
    """`POST /v1/completions`: `prompt` is text, token ids, or a list of either (n choices each)."""
    body = _check(server, body, _COMPLETION_FIELDS, "/v1/completions")
    if body.get("echo"):
        raise bad("echo", "echoing the prompt is not supported by axrl serve")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "missing required field")
    if schema.token_ids(prompt, "prompt") is not None or isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise bad("prompt", "must be a string, a list of token ids, or a list of those")
    ids = [(schema.token_ids(p, f"prompt[{i}]") if isinstance(p, list) else server.encode_text(p))
           for i, p in enumerate(prompts)]
    if any(i is None for i in ids):
        raise bad("prompt", "lists must hold integer token ids")
    reqs = _requests(server, body, ids, "max_tokens", body.get("logprobs") is not None)
    call = _Call(server, body, reqs, parse_stops(body), chat=False,
                 skip_special=bool(body.get("skip_special_tokens", True)),
                 envelope=replies.Envelope(chat=False, model=server.model_name))
    return await _respond(call, is_disconnected)


async def chat_completions(server: AxrlServer, body: Any, is_disconnected: Any) -> Reply:
    """`POST /v1/chat/completions` over the model's chat template (or pre-tokenized `input_ids`)."""
    body = _check(server, body, _CHAT_FIELDS, "/v1/chat/completions")
    reqs = _requests(server, body, [_chat_ids(server, body)], "max_completion_tokens", bool(body.get("logprobs")))
    call = _Call(server, body, reqs, parse_stops(body), chat=True, skip_special=False,
                 envelope=replies.Envelope(chat=True, model=server.model_name))
    return await _respond(call, is_disconnected)


def _check(server: AxrlServer, body: Any, allowed: frozenset[str], endpoint: str) -> dict[str, Any]:
    body = schema.check_body(body, allowed, endpoint)
    schema.check_model(body, server.model_name)
    schema.integer(body, "n", 1, server.cfg.max_running_requests,
                   " (the engine's slots, --max-running-requests)")
    if body.get("stream") and (body.get("logprobs") or body.get("return_meta_info")):
        raise bad("stream", "logprobs and return_meta_info are only returned without stream")
    schema.include_usage(body)
    return body


def _chat_ids(server: AxrlServer, body: dict[str, Any]) -> list[int]:
    if body.get("input_ids") is not None:
        parsed = schema.token_ids(body["input_ids"], "input_ids")
        if parsed is None:
            raise bad("input_ids", "must be a list of integer token ids")
        return parsed
    messages = schema.check_messages(body, alternative=" (or input_ids)")
    if server.tokenizer is None:
        raise bad("messages", f"the model directory {server.cfg.model_path} has no tokenizer; send input_ids")
    tools = schema.check_tools(body)
    try:
        return list(server.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001 — a template error is the request's fault
        raise bad("messages", f"cannot render the chat template: {e}") from None


def _requests(server: AxrlServer, body: dict[str, Any], prompts: list[list[int]], max_tokens_key: str,
              want_logprob: bool) -> list[GenerateRequest]:
    """n GenerateRequests per prompt from the OpenAI sampling fields (validated by the SGLang parser)."""
    sampling: dict[str, Any] = {"max_new_tokens": body.get(max_tokens_key) or body.get("max_tokens") or 16}
    sampling.update({dst: body[src] for src, dst in _SAMPLING if body.get(src) is not None})
    sp = sampling_from_wire(sampling, "request")
    routed = bool(body.get("return_routed_experts"))
    if routed and not server.cfg.enable_return_routed_experts:
        raise bad("return_routed_experts", "start the server with --enable-return-routed-experts")
    n, rid = int(body.get("n") or 1), body.get("rid") or uuid.uuid4().hex
    out = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            seed = sp.seed if j == 0 or sp.seed is None else derive_seed(sp.seed, j)
            out.append(GenerateRequest(
                input_ids=list(ids), sampling_params=dataclasses.replace(sp, seed=seed),
                return_logprob=want_logprob or bool(body.get("return_meta_info")), return_routed_experts=routed,
                rid=rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}"))
    return out


# ---------------------------------------------------------------------------- generation and stops

def _cut(call: _Call, res: GenerateResult) -> tuple[GenerateResult, str]:
    """``res`` and its reply text, cut at the first stop string (ids, logprobs, versions and
    routing rows of the kept tokens; finish "stop" with the matched string). Unchanged without."""
    ids = list(res.output_ids)
    cut = cut_at_stop(ids, call.text, call.stops)
    if cut is None:
        return res, call.text(ids)
    routing = res.routed_experts
    if routing is not None:
        routing = routing[: max(0, routing.shape[0] - (len(ids) - cut.keep))]
    return dataclasses.replace(res, output_ids=ids[:cut.keep], output_logprobs=list(res.output_logprobs)[:cut.keep],
                               output_weight_versions=list(res.output_weight_versions)[:cut.keep],
                               routed_experts=routing,
                               finish_reason={"type": "stop", "matched": cut.matched}), cut.text


def _progress(call: _Call, k: int, state: Any, final: list[tuple[GenerateResult, str] | None],
              want_text: bool) -> str | None:
    """Choice k's text so far (None once it is final, hit a stop, or without `want_text` and
    stops); records its final result (cut) and aborts it at its first stop string — its result
    then comes back aborted, and is cut."""
    if isinstance(state, GenerateResult):
        final[k] = _cut(call, state)
        return None
    if not want_text and not call.stops:
        return None  # nothing to watch: spare the decode
    text = call.text(state[0])
    if call.stops and first_stop(text, call.stops) is not None:
        call.server.engine.abort(call.requests[k].rid)
        return None
    return text


async def _follow(call: _Call, is_disconnected: Any, final: list[tuple[GenerateResult, str] | None],
                  want_text: bool) -> AsyncIterator[list[str | None]]:
    """Run the call's requests, filling `final`; yield each unfinished choice's text per poll."""
    async for states in call.server.follow(call.requests, is_disconnected):
        yield [None if final[k] is not None else _progress(call, k, state, final, want_text)
               for k, state in enumerate(states)]


async def _results(call: _Call, is_disconnected: Any) -> list[tuple[GenerateResult, str]]:
    """Each request's final result with its reply text (cut at stops)."""
    final: list[tuple[GenerateResult, str] | None] = [None] * len(call.requests)
    async for _ in _follow(call, is_disconnected, final, want_text=False):
        pass
    missing = [r.rid for r, f in zip(call.requests, final) if f is None]
    if missing:
        raise ApiError(400, f"the client went away before {missing[0]} finished")
    return [f for f in final if f is not None]


# ---------------------------------------------------------------------------- replies

async def _respond(call: _Call, is_disconnected: Any) -> Reply:
    if call.body.get("stream"):
        return _stream(call, is_disconnected)
    results = await _results(call, is_disconnected)
    make = _chat_choice if call.chat else _completion_choice
    choices = [make(call, k, req, res, text) for k, (req, (res, text)) in enumerate(zip(call.requests, results))]
    return call.envelope.reply(choices, _usage(call, [res for res, _ in results]))


def _usage(call: _Call, results: list[GenerateResult]) -> dict[str, Any]:
    # the n choices of a prompt share it: OpenAI counts each prompt once, and so the cached
    # prompt tokens (OpenAI's and SGLang's prompt_tokens_details.cached_tokens)
    n = int(call.body.get("n") or 1)
    return replies.usage(sum(len(r.input_ids) for r in call.requests[::n]), sum(len(r.output_ids) for r in results),
                         cached_tokens=sum(int(r.meta.get("cached_tokens", 0)) for r in results[::n]))


def _extras(call: _Call, req: GenerateRequest, res: GenerateResult) -> dict[str, Any]:
    """SGLang's additions to a choice: token ids, meta_info."""
    out: dict[str, Any] = {}
    if call.body.get("return_token_ids"):
        out["prompt_token_ids"] = list(req.input_ids)
        out["response_token_ids"] = list(res.output_ids)
    if call.body.get("return_meta_info"):
        out["meta_info"] = call.server.to_wire(res, req, {"skip_special_tokens": True,
                                                          "text_in_logprobs": False})["meta_info"]
    return out


def _completion_choice(call: _Call, k: int, req: GenerateRequest, res: GenerateResult, text: str) -> dict[str, Any]:
    choice = replies.completion_choice(k, text, replies.finish_reason(res.finish_type, tool_calls=False))
    choice["matched_stop"] = res.finish_reason.get("matched")
    if call.body.get("logprobs") is not None:
        tokens = [call.server.decode([t], False) for t in res.output_ids]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(res.output_logprobs),
                              "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, res.output_logprobs)],
                              "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}
    return {**choice, **_extras(call, req, res)}


def _chat_message(call: _Call, text: str) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool_calls, reasoning) of a chat reply: the family's reasoning split off first (a
    call the model only thought about is no call), the calls read from the rest."""
    reasoning, rest = replies.reasoning_of(call.server.tokenizer, text)
    content, calls = replies.tool_calls_of(call.server.tokenizer, call.body.get("tools"), rest)
    return content, calls, reasoning


def _chat_choice(call: _Call, k: int, req: GenerateRequest, res: GenerateResult, text: str) -> dict[str, Any]:
    content, calls, reasoning = _chat_message(call, text)
    tok = call.server.tokenizer
    message = replies.assistant_message(content, calls, reasoning=reasoning,
                                        with_reasoning=tok is not None and tok.reasoning_parser is not None)
    choice = replies.chat_choice(k, message, replies.finish_reason(res.finish_type, tool_calls=bool(calls)))
    choice["matched_stop"] = res.finish_reason.get("matched")
    if call.body.get("logprobs"):
        decode = call.server.decode
        choice["logprobs"] = {"content": [
            {"token": decode([t], False), "logprob": lp, "bytes": list(decode([t], False).encode()),
             "top_logprobs": []} for t, lp in zip(res.output_ids, res.output_logprobs)]}
    return {**choice, **_extras(call, req, res)}


def _final(call: _Call, k: int, res: GenerateResult, text: str) -> Final:
    """The end of choice k's stream."""
    content, calls, reasoning = _chat_message(call, text) if call.chat else (text, [], None)
    return Final(content, replies.finish_reason(res.finish_type, tool_calls=bool(calls)), calls,
                 {"matched_stop": res.finish_reason.get("matched"), **_extras(call, call.requests[k], res)},
                 reasoning=reasoning)


def _sendable(call: _Call, text: str) -> Progress:
    """What of a running reply may be streamed: the text before stops and a tool call's opening,
    split into reasoning and content where the family has a reasoning parser (chat)."""
    text = sendable(text, call.stops, call.tool_start)
    split = replies.streamed_reasoning(call.server.tokenizer, text) \
        if call.chat and call.server.tokenizer is not None else None
    return text if split is None else Reasoned(*split)


def _stream(call: _Call, is_disconnected: Any) -> AsyncIterator[bytes]:
    final: list[tuple[GenerateResult, str] | None] = [None] * len(call.requests)
    done: list[bool] = [False] * len(call.requests)

    async def progress() -> AsyncIterator[list[Progress]]:
        async for texts in _follow(call, is_disconnected, final, want_text=True):
            out: list[Progress] = []
            for k, text in enumerate(texts):
                if final[k] is not None and not done[k]:
                    done[k] = True
                    out.append(_final(call, k, *final[k]))  # type: ignore[misc]
                elif text is not None:
                    out.append(_sendable(call, text))
                else:
                    out.append(None)
            yield out

    usage = (lambda: _usage(call, [f[0] for f in final if f is not None])) \
        if schema.include_usage(call.body) else None
    return sse_stream(call.envelope, len(call.requests), progress(), usage)
