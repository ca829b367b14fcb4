"""OpenAI `/v1/completions` and `/v1/chat/completions` for `axrl serve` (black-box agents).

Prompts may be text, chat messages or token ids (`prompt` as ids; chat `input_ids`, as SGLang
accepts). Token-level data comes back the SGLang way: `return_token_ids` adds
`prompt_token_ids` / `response_token_ids` to each choice, `return_meta_info` adds the engine's
`meta_info` (logprobs with token ids, routed experts, weight_version). Chat replies are parsed
for the template's tool-call blocks into OpenAI `tool_calls` when the request declares `tools`.

- `model` must be the served name (`GET /v1/models`); another one is a 404, as OpenAI answers.
- `n` choices are `n` requests admitted together (choice j samples with seed `derive_seed(seed, j)`
  for j ≥ 1, so choice 0 of a seeded request is the `n = 1` reply); at most the engine's slots.
- `stop` (a string or a list): the engine stops on token ids only, so the server watches the
  decoded text as tokens arrive, aborts the request at the first stop string and cuts the reply
  (text, token ids, logprobs) right before it — the same cut whenever the abort lands.
- `stream`: OpenAI's SSE chunks (`chat.completion.chunk` / `text_completion`), then
  `data: [DONE]`; `stream_options.include_usage` adds the usage chunk. Text is held back while it
  could still turn into a stop string or a tool call; tool calls come as one `tool_calls` delta.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sampling import derive_seed
from axrl.inference.serving import AxrlServer, BadRequest, ModelNotFound
from axrl.inference.sglang.wire import sampling_from_wire
from axrl.tokenizer import Tokenizer

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
           "ignore_eos", "skip_special_tokens", "return_token_ids", "return_meta_info", "user", "logprobs",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "no_stop_trim", "rid",
           "return_routed_experts", "stream_options"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logit_bias"}
_CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens",
                          "input_ids", "chat_template_kwargs", "parallel_tool_calls", "response_format"}
_REPLACEMENT = "\ufffd"  # what a cut multi-byte character decodes to while its other bytes are pending


@dataclasses.dataclass
class _Call:
    """One OpenAI request: its engine requests (one per choice) and how to render their text."""

    endpoint: str                 # "chat" | "completion"
    body: dict[str, Any]
    requests: list[GenerateRequest]
    stops: list[str]
    chat: bool
    skip_special: bool
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def _check_fields(server: AxrlServer, body: Any, allowed: set[str], endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the {endpoint} body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown {endpoint} field")
    model = body.get("model")
    if model is not None and model != server.model_name:
        raise ModelNotFound(f"model: {model!r} is not served here; this server serves {server.model_name!r} "
                            "(GET /v1/models)")
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= server.cfg.max_running_requests:
        raise BadRequest(f"n={n!r}: choices per request must be an integer in [1, {server.cfg.max_running_requests}] "
                         "(the engine's slots, --max-running-requests)")
    if body.get("stream") and (body.get("logprobs") or body.get("return_meta_info")):
        raise BadRequest("stream: logprobs and return_meta_info are only returned without stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest("stream_options: only {\"include_usage\": bool} is supported")
    return body


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


def _requests(server: AxrlServer, body: dict[str, Any], prompts: list[list[int]], max_tokens_key: str,
              want_logprob: bool) -> list[GenerateRequest]:
    """n GenerateRequests per prompt from the OpenAI sampling fields (validated by the SGLang parser)."""
    sampling: dict[str, Any] = {"max_new_tokens": body.get(max_tokens_key) or body.get("max_tokens") or 16}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"), ("min_p", "min_p"),
                     ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                     ("repetition_penalty", "repetition_penalty")):
        if body.get(src) is not None:
            sampling[dst] = body[src]
    sp = sampling_from_wire(sampling, "request")
    routed = bool(body.get("return_routed_experts"))
    if routed and not server.cfg.enable_return_routed_experts:
        raise BadRequest("return_routed_experts: start the server with --enable-return-routed-experts")
    n, rid = int(body.get("n", 1)), body.get("rid") or uuid.uuid4().hex
    out = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            seed = sp.seed if j == 0 or sp.seed is None else derive_seed(sp.seed, j)
            k = i * n + j
            out.append(GenerateRequest(
                input_ids=list(ids), sampling_params=dataclasses.replace(sp, seed=seed),
                return_logprob=want_logprob or bool(body.get("return_meta_info")), return_routed_experts=routed,
                rid=rid if len(prompts) * n == 1 else f"{rid}-{k}"))
    return out


def _ids(value: Any, field: str) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and not value:
        raise BadRequest(f"{field} is empty")
    return None


# ---------------------------------------------------------------------------- text and stops

def _text(server: AxrlServer, call: _Call, ids: list[int]) -> str:
    """The reply text of output ids: chat keeps tool-call tags and drops the end-of-turn token."""
    if call.chat and server.tokenizer is not None and ids and ids[-1] in server.tokenizer.stop_token_ids:
        ids = ids[:-1]
    return server.decode(ids, skip_special_tokens=call.skip_special)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def _cut(server: AxrlServer, call: _Call, res: GenerateResult) -> tuple[GenerateResult, str]:
    """``res`` and its reply text, cut at the first stop string: the text ends right before it, the
    ids and logprobs keep the tokens before the one that completed it. Unchanged without a stop."""
    ids = list(res.output_ids)
    text = _text(server, call, ids)
    if not call.stops or _first_stop(text, call.stops) is None:
        return res, text
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop (monotone in the prefix length)
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop(_text(server, call, ids[:mid]), call.stops) is None:
            lo = mid + 1
        else:
            hi = mid
    text = _text(server, call, ids[:lo])
    pos, matched = _first_stop(text, call.stops)  # type: ignore[misc]
    keep = lo - 1
    routing = res.routed_experts
    if routing is not None:
        routing = routing[: max(0, routing.shape[0] - (len(ids) - keep))]
    versions = list(res.output_weight_versions)[:keep]
    return dataclasses.replace(res, output_ids=ids[:keep], output_logprobs=list(res.output_logprobs)[:keep],
                               output_weight_versions=versions, routed_experts=routing,
                               finish_reason={"type": "stop", "matched": matched}), text[:pos]


async def _results(server: AxrlServer, call: _Call, is_disconnected: Any) -> list[tuple[GenerateResult, str]]:
    """Run the call's requests to completion, aborting each at its first stop string; each final
    result with its reply text."""
    final: list[tuple[GenerateResult, str] | None] = [None] * len(call.requests)
    async for states in server.follow(call.requests, is_disconnected):
        for k, state in enumerate(states):
            if final[k] is None and isinstance(state, GenerateResult):
                final[k] = _cut(server, call, state)
            elif final[k] is None and call.stops and _first_stop(_text(server, call, state[0]), call.stops):
                server.engine.abort(call.requests[k].rid)  # the final result arrives aborted; _cut marks it
    missing = [r.rid for r, f in zip(call.requests, final) if f is None]
    if missing:
        raise BadRequest(f"the client went away before {missing[0]} finished")
    return [f for f in final if f is not None]


# ---------------------------------------------------------------------------- responses

def _finish(res: GenerateResult, tool_calls: bool = False) -> tuple[str, Any]:
    kind = res.finish_type
    if tool_calls and kind == "stop":
        return "tool_calls", res.finish_reason.get("matched")
    return {"stop": "stop", "length": "length"}.get(kind, "abort"), res.finish_reason.get("matched")


def _extras(server: AxrlServer, choice: dict[str, Any], body: dict[str, Any], req: GenerateRequest,
            res: GenerateResult) -> dict[str, Any]:
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = list(req.input_ids)
        choice["response_token_ids"] = list(res.output_ids)
    if body.get("return_meta_info"):
        choice["meta_info"] = server.to_wire(res, req, {"skip_special_tokens": True,
                                                        "text_in_logprobs": False})["meta_info"]
    return choice


def _usage(call: _Call, results: list[GenerateResult]) -> dict[str, int]:
    # the n choices of a prompt share it: OpenAI counts each prompt once
    n = int(call.body.get("n", 1))
    prompt = sum(len(r.input_ids) for r in call.requests[::n])
    completion = sum(len(r.output_ids) for r in results)
    # OpenAI's (and SGLang's) prompt_tokens_details.cached_tokens: prompt tokens served from the
    # engine's prefix cache, counted once per prompt as prompt_tokens is
    cached = sum(int(r.meta.get("cached_tokens", 0)) for r in results[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_calls_of(tokenizer: Tokenizer | None, tools: Any, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls, OpenAI tool_calls) of a chat reply; no calls without `tools`
    (shared by `axrl serve` and the black-box agent proxy)."""
    if not tools or tokenizer is None:
        return text, []
    good = [c for c in tokenizer.parse_tool_calls(text) if c["error"] is None]
    if not good:
        return text, []
    start = (tokenizer.tool_call_tags or ("<tool_call>", ""))[0]
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in good]
    return text.split(start)[0].strip() or None, calls


def _completion_choice(server: AxrlServer, call: _Call, k: int, req: GenerateRequest,
                       res: GenerateResult, text: str) -> dict[str, Any]:
    reason, matched = _finish(res)
    choice: dict[str, Any] = {"index": k, "text": text, "logprobs": None,
                              "finish_reason": reason, "matched_stop": matched}
    if call.body.get("logprobs") is not None:
        tokens = [server.decode([t], False) for t in res.output_ids]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(res.output_logprobs),
                              "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, res.output_logprobs)],
                              "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}
    return _extras(server, choice, call.body, req, res)


def _chat_choice(server: AxrlServer, call: _Call, k: int, req: GenerateRequest, res: GenerateResult,
                 text: str) -> dict[str, Any]:
    content, calls = tool_calls_of(server.tokenizer, call.body.get("tools"), text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    reason, matched = _finish(res, tool_calls=bool(calls))
    choice: dict[str, Any] = {"index": k, "message": message, "logprobs": None, "finish_reason": reason,
                              "matched_stop": matched}
    if call.body.get("logprobs"):
        choice["logprobs"] = {"content": [
            {"token": server.decode([t], False), "logprob": lp, "bytes": list(server.decode([t], False).encode()),
             "top_logprobs": []} for t, lp in zip(res.output_ids, res.output_logprobs)]}
    return _extras(server, choice, call.body, req, res)


async def _respond(server: AxrlServer, call: _Call, is_disconnected: Any) -> dict[str, Any] | AsyncIterator[bytes]:
    if call.body.get("stream"):
        return _stream(server, call, is_disconnected)
    results = await _results(server, call, is_disconnected)
    make = _chat_choice if call.chat else _completion_choice
    choices = [make(server, call, k, req, res, text)
               for k, (req, (res, text)) in enumerate(zip(call.requests, results))]
    obj, prefix = ("chat.completion", "chatcmpl") if call.chat else ("text_completion", "cmpl")
    return {"id": f"{prefix}-{call.id}", "object": obj, "created": call.created, "model": server.model_name,
            "choices": choices, "usage": _usage(call, [res for res, _ in results])}


# ---------------------------------------------------------------------------- streaming

def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _held_back(server: AxrlServer, call: _Call, text: str) -> int:
    """How many characters at the end of a running reply's text may not be sent yet: a possible
    start of a stop string or of a tool call, or a character whose bytes are still arriving."""
    markers = list(call.stops)
    if call.chat and call.body.get("tools") and server.tokenizer is not None:
        start = (server.tokenizer.tool_call_tags or ("<tool_call>", ""))[0]
        if start in text:
            return len(text) - text.index(start)
        markers.append(start)
    hold = max((i for m in markers for i in range(1, len(m)) if text.endswith(m[:i])), default=0)
    if text.endswith(_REPLACEMENT):
        hold = max(hold, len(text) - len(text.rstrip(_REPLACEMENT)))
    return hold


async def _stream(server: AxrlServer, call: _Call, is_disconnected: Any) -> AsyncIterator[bytes]:
    obj, prefix = ("chat.completion.chunk", "chatcmpl") if call.chat else ("text_completion", "cmpl")
    head = {"id": f"{prefix}-{call.id}", "object": obj, "created": call.created, "model": server.model_name}

    def chunk(k: int, text: str | None = None, finish: str | None = None, **extra: Any) -> bytes:
        """One choice's chunk: chat puts the text (and tool calls, role) in a delta."""
        if call.chat:
            delta = {**({"content": text} if text is not None else {}),
                     **{key: extra.pop(key) for key in ("role", "tool_calls") if key in extra}}
            choice: dict[str, Any] = {"index": k, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": k, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [{**choice, **extra}]})

    n = len(call.requests)
    sent = [0] * n                     # characters of each reply already sent
    final: list[GenerateResult | None] = [None] * n
    try:
        if call.chat:
            for k in range(n):
                yield chunk(k, "", role="assistant")
        async for states in server.follow(call.requests, is_disconnected):
            for k, state in enumerate(states):
                if final[k] is not None:
                    continue
                if isinstance(state, GenerateResult):
                    res, text = _cut(server, call, state)
                    final[k] = res
                    content, calls = tool_calls_of(server.tokenizer, call.body.get("tools"), text) if call.chat else (text, [])
                    rest = (content or "")[sent[k]:]
                    if rest:
                        yield chunk(k, rest)
                    if calls:
                        yield chunk(k, None, tool_calls=[{"index": i, **c} for i, c in enumerate(calls)])
                    yield chunk(k, None, _finish(res, tool_calls=bool(calls))[0],
                                **_extras(server, {}, call.body, call.requests[k], res))
                    continue
                text = _text(server, call, state[0])
                if call.stops and _first_stop(text, call.stops) is not None:
                    server.engine.abort(call.requests[k].rid)  # its result comes back aborted, then is cut
                    continue
                ready = len(text) - _held_back(server, call, text)
                if ready > sent[k]:
                    yield chunk(k, text[sent[k]:ready])
                    sent[k] = ready
        done = [f for f in final if f is not None]
        if len(done) == n and (call.body.get("stream_options") or {}).get("include_usage"):
            yield _sse({**head, "choices": [], "usage": _usage(call, done)})
        yield b"data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 — errors after the headers went out are reported in-band
        yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError"}})
        yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------- endpoints

async def completions(server: AxrlServer, body: Any, is_disconnected: Any) -> dict[str, Any] | AsyncIterator[bytes]:
    """`POST /v1/completions`: `prompt` is text, token ids, or a list of either (n choices each)."""
    body = _check_fields(server, body, _COMPLETION_FIELDS, "/v1/completions")
    if body.get("echo"):
        raise BadRequest("echo: echoing the prompt is not supported by axrl serve")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt: missing required field")
    single = _ids(prompt, "prompt")
    if single is not None or isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a list of those")
    ids = [(_ids(p, f"prompt[{i}]") if isinstance(p, list) else server.encode_text(p)) for i, p in enumerate(prompts)]
    if any(i is None for i in ids):
        raise BadRequest("prompt: lists must hold integer token ids")
    reqs = _requests(server, body, ids, "max_tokens", body.get("logprobs") is not None)
    call = _Call("completion", body, reqs, _stops(body), chat=False,
                 skip_special=bool(body.get("skip_special_tokens", True)))
    return await _respond(server, call, is_disconnected)


def _chat_ids(server: AxrlServer, body: dict[str, Any]) -> list[int]:
    ids = body.get("input_ids")
    if ids is not None:
        parsed = _ids(ids, "input_ids")
        if parsed is None:
            raise BadRequest("input_ids must be a list of integer token ids")
        return parsed
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list of {role, content} messages is required (or input_ids)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role")
    if server.tokenizer is None:
        raise BadRequest(f"messages: the model directory {server.cfg.model_path} has no tokenizer; send input_ids")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list of tool definitions")
    try:
        return list(server.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001 — a template error is the request's fault
        raise BadRequest(f"messages: cannot render the chat template: {e}") from None


async def chat_completions(server: AxrlServer, body: Any,
                           is_disconnected: Any) -> dict[str, Any] | AsyncIterator[bytes]:
    """`POST /v1/chat/completions` over the model's chat template (or pre-tokenized `input_ids`)."""
    body = _check_fields(server, body, _CHAT_FIELDS, "/v1/chat/completions")
    reqs = _requests(server, body, [_chat_ids(server, body)], "max_completion_tokens", bool(body.get("logprobs")))
    call = _Call("chat", body, reqs, _stops(body), chat=True, skip_special=False)
    return await _respond(server, call, is_disconnected)
