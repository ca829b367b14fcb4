"""What the API translations (`anthropic_messages`, `responses`) share: they turn a request into
an OpenAI chat-completions body — the internal chat form (HF-convention messages + tools) — run it
through the backend's own chat path (`ChatFn`: the proxy's recording session or `axrl serve`'s
engine), and turn the chat reply back. Generation, token recording, stop strings and tool-call
parsing therefore happen in one place only. A streamed call runs the chat path streamed and
translates its chunks as they arrive (`chat_deltas`): what text may be sent when (held back while
it could become a stop string or a tool call) is decided by the chat stream alone."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from axrl.inference.openai.errors import ApiError, bad

# The backend's chat path: an OpenAI chat body -> the OpenAI chat reply, or (`stream`) its SSE
# chunks (one event per item, as `streaming.sse_stream` yields them).
ChatFn = Callable[[dict[str, Any]], Awaitable[Any]]
# What a streamed chat reply says, in order: ("text", delta)*, ("tool_call", call)*, ("done", reply).
Delta = tuple[str, Any]


class StreamError(RuntimeError):
    """The chat stream reported an error in-band (after its headers went out)."""


async def run_chat(chat: ChatFn, body: dict[str, Any], renames: Mapping[str, str], stream: bool = False) -> Any:
    """`chat(body)`: the chat reply, or (`stream`) its chunk stream with the usage chunk asked for;
    a client error of the chat path names the field as the caller's API does (`renames`: chat
    field -> API field, e.g. "stop" -> "stop_sequences")."""
    request = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    try:
        return await chat(request)
    except ApiError as e:
        raise renamed(e, renames) from None


async def chat_deltas(stream: AsyncIterator[bytes]) -> AsyncIterator[Delta]:
    """Choice 0 of a streamed chat reply as it arrives: ("text", content delta) and ("tool_call",
    call) items, then ("done", the chat reply object they add up to: what the same call answers
    unstreamed, so the APIs build their final objects with their unstreamed code). Raises
    `StreamError` on an in-band error; closes `stream` however it ends (the chat path then
    aborts what is still generating)."""
    content, calls, usage = "", [], None
    finish: str | None = None
    matched: Any = None
    try:
        async for raw in stream:
            if not raw.startswith(b"data: {"):
                continue  # data: [DONE]
            chunk = json.loads(raw[len(b"data: "):])
            if "error" in chunk:
                raise StreamError(chunk["error"].get("message", "the chat stream failed"))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content += delta["content"]
                    yield "text", delta["content"]
                for call in delta.get("tool_calls") or []:
                    calls.append({k: v for k, v in call.items() if k != "index"})
                    yield "tool_call", calls[-1]
                if choice.get("finish_reason") is not None:
                    finish, matched = choice["finish_reason"], choice.get("matched_stop")
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    message: dict[str, Any] = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
    yield "done", {"choices": [{"index": 0, "message": message, "finish_reason": finish, "matched_stop": matched}],
                   "usage": usage or {"prompt_tokens": 0, "completion_tokens": 0}}


def renamed(error: ApiError, renames: Mapping[str, str]) -> ApiError:
    """`error` with its field (and the message's leading field name) in the caller's API."""
    name = renames.get(error.param or "", error.param)
    message = str(error)
    if error.param and name != error.param and message.startswith(error.param):
        message = name + message[len(error.param):]
    return ApiError(error.status, message, param=name, code=error.code, retry_after=error.retry_after)


def new_id(prefix: str) -> str:
    """A fresh object id in the API's style (`msg_…`, `resp_…`, `toolu_…`)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def function_tool(field: str, tool: dict[str, Any], schema_key: str) -> dict[str, Any]:
    """An OpenAI chat tool definition from an API's tool (`field` names it in errors; its JSON
    schema is `tool[schema_key]`)."""
    name, description, parameters = tool.get("name"), tool.get("description"), tool.get(schema_key)
    if not isinstance(name, str) or not name:
        raise bad(f"{field}.name", "must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise bad(f"{field}.description", "must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{field}.{schema_key}", "must be a JSON-schema object")
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI chat tool call (as the chat path records replies): arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def call_arguments(call: dict[str, Any]) -> Any:
    """The parsed arguments of a chat reply's tool call (the chat path writes valid JSON)."""
    return json.loads(call["function"]["arguments"] or "{}")


def text_parts(field: str, content: Any, kinds: tuple[str, ...]) -> str:
    """The text of `content`: a string, or a list of `{"type": kind, "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(field, f"must be a string or a list of content blocks, got {content!r}")
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            raise bad(f"{field}[{i}]", f"only {'/'.join(kinds)} blocks with a string text are supported, got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def named_sse(event: str, obj: dict[str, Any]) -> bytes:
    """One server-sent event with an `event:` name (Anthropic's and the Responses API's framing)."""
    return f"event: {event}\ndata: {json.dumps(obj)}\n\n".encode()
