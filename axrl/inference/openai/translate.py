"""What the API translations (`anthropic_messages`, `responses`) share: they turn a request into
an OpenAI chat-completions body — the internal chat form (HF-convention messages + tools) — run it
through the backend's own chat path (`ChatFn`: the proxy's recording session or `axrl serve`'s
engine), and turn the chat reply back. Generation, token recording, stop strings and tool-call
parsing therefore happen in one place only."""

from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Callable, Mapping

from axrl.inference.openai.errors import ApiError, bad

# The backend's chat path: an OpenAI chat body (never streamed) -> the OpenAI chat reply.
ChatFn = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def run_chat(chat: ChatFn, body: dict[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """`chat(body)`; a client error of the chat path names the field as the caller's API does
    (`renames`: chat field -> API field, e.g. "stop" -> "stop_sequences")."""
    try:
        return await chat({**body, "stream": False})
    except ApiError as e:
        raise renamed(e, renames) from None


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
