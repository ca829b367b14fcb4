"""Anthropic's Messages API (`POST /v1/messages`) over the chat path (see `translate`).

Supported: `system` (a string or text blocks), `messages` with text, `tool_use` and `tool_result`
blocks, `tools` (name, description, input_schema), `tool_choice`, `stop_sequences`,
`max_tokens` (required), `temperature`, `top_p`, `stream` (Anthropic's SSE events, translated
from the chat path's stream as its tokens arrive: a `text_delta` per chat content delta). Replies carry `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use)
and `usage` (input_tokens, output_tokens). Errors are Anthropic's error object.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from axrl.inference.openai import schema
from axrl.inference.openai.errors import ApiError, bad
from axrl.inference.openai.translate import (ChatFn, StreamError, call_arguments, chat_deltas, function_tool,
                                             named_sse, new_id, run_chat, text_parts, tool_call)

FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                    "stream", "tools", "tool_choice", "metadata"})
# Anthropic's error `type` per status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error"}
# Fields of the chat path whose errors are about these Messages fields.
_RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
Reply = dict[str, Any] | AsyncIterator[bytes]


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": str(error)}}


async def create_message(body: Any, chat: ChatFn, model: str | None = None) -> Reply:
    """`POST /v1/messages`: the reply (or its SSE events) of `chat` run on the translated body;
    `model` names the served model in replies (None: the request's)."""
    request = to_chat(body)
    if body.get("stream"):
        return _events(await run_chat(chat, request, _RENAMES, stream=True), model or body.get("model") or "")
    reply = await run_chat(chat, request, _RENAMES)
    return from_chat(reply, model or body.get("model") or reply.get("model", ""))


# ---------------------------------------------------------------------------- request

def to_chat(body: Any) -> dict[str, Any]:
    """The OpenAI chat body of a Messages request (400s name the Messages field)."""
    body = schema.check_body(body, FIELDS, "/v1/messages")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required")
    chat: dict[str, Any] = {"messages": _system(body.get("system")) + _messages(body.get("messages")),
                            "max_tokens": schema.integer(body, "max_tokens", 1, 1 << 20)}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    schema.number(body, "temperature", 0.0, 1.0)  # Anthropic's ranges, whatever the backend would take
    schema.number(body, "top_p", 0.0, 1.0)
    chat.update({k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None})
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop_sequences", f"must be a list of non-empty strings, got {stops!r}")
        if stops:
            chat["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "must be a list of tool definitions")
        chat["tools"] = [function_tool(f"tools[{i}]", t, "input_schema") for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    """The system prompt as a chat system message (none when absent or empty)."""
    if system is None:
        return []
    text = text_parts("system", system, ("text",))
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as chat messages: a user turn's `tool_result` blocks become `tool` messages
    (before its text, as Anthropic orders them), an assistant's `tool_use` blocks its tool_calls."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "a non-empty list of {role, content} messages is required")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad(f"messages[{i}].role", f"must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad(f"messages[{i}].content", f"must be a string or a list of content blocks, got {content!r}")
        out.extend(_user(i, blocks) if role == "user" else [_assistant(i, blocks)])
    if messages[-1]["role"] == "assistant":  # the chat path starts a new turn; it cannot continue one
        raise bad(f"messages[{len(messages) - 1}].role", "a final assistant message (prefill) is not supported")
    return out


def _user(i: int, blocks: list[Any]) -> list[dict[str, Any]]:
    tools, texts = [], []
    for j, b in enumerate(blocks):
        field, kind = f"messages[{i}].content[{j}]", b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{field}.tool_use_id", "must be the id of a tool_use block")
            result = text_parts(f"{field}.content", b.get("content", ""), ("text",))
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        else:
            texts.append(_text(field, b))
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant(i: int, blocks: list[Any]) -> dict[str, Any]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        field, kind = f"messages[{i}].content[{j}]", b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad(field, "a tool_use block needs a string name and an object input")
            calls.append(tool_call(str(b.get("id", "")), b["name"], b.get("input", {})))
        else:
            texts.append(_text(field, b))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _text(field: str, block: Any) -> str:
    """A text block's text (any other block kind is a 400 naming the block)."""
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else block
        raise bad(field, f"only text, tool_use (assistant) and tool_result (user) blocks are supported, got {kind!r}")
    return block["text"]


def _tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice as OpenAI's (auto, any -> required, none, a named tool)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", f"must be {{type: auto|any|none}} or {{type: tool, name}}, got {choice!r}")


# ---------------------------------------------------------------------------- reply

def from_chat(reply: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages reply of a chat reply: text then tool_use blocks, stop reason, usage."""
    choice = reply["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [_tool_use(c) for c in message.get("tool_calls") or []]
    matched = choice.get("matched_stop")
    stop = "stop_sequence" if isinstance(matched, str) else _STOP_REASONS.get(choice["finish_reason"], "end_turn")
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": matched if isinstance(matched, str) else None,
            "usage": {"input_tokens": reply["usage"]["prompt_tokens"],
                      "output_tokens": reply["usage"]["completion_tokens"]}}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """The tool_use block of a chat reply's tool call."""
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": call_arguments(call)}


async def _events(chunks: AsyncIterator[bytes], model: str) -> AsyncIterator[bytes]:
    """Anthropic's stream of the chat stream `chunks`, translated as they arrive: message_start;
    once text arrives a text block (its start, a text_delta per chat delta, its stop); a tool_use
    block per tool call (its input in one input_json_delta: the chat path sends a call once it is
    whole); then message_delta (stop reason, usage: the unstreamed reply's) and message_stop. An
    error mid-stream is Anthropic's `error` event. The prompt's size is known at the end only:
    message_start says 0 input tokens, message_delta the real count (SDKs take the latter)."""
    yield _event("message_start", message={
        "id": new_id("msg"), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
    index, text_open = 0, False
    try:
        async for kind, value in chat_deltas(chunks):
            if kind == "text":
                if not text_open:
                    yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": value})
                continue
            if text_open:  # the text ends where a tool call or the end comes
                yield _event("content_block_stop", index=index)
                index, text_open = index + 1, False
            if kind == "tool_call":
                block = _tool_use(value)
                yield _event("content_block_start", index=index, content_block={**block, "input": {}})
                yield _event("content_block_delta", index=index,
                             delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                yield _event("content_block_stop", index=index)
                index += 1
            else:
                message = from_chat(value, model)
                yield _event("message_delta", delta={"stop_reason": message["stop_reason"],
                                                     "stop_sequence": message["stop_sequence"]},
                             usage=message["usage"])
                yield _event("message_stop")
    except StreamError as e:
        yield _event("error", error={"type": "api_error", "message": str(e)})


def _event(kind: str, **fields: Any) -> bytes:
    """One named Anthropic event: `{"type": kind, **fields}`."""
    return named_sse(kind, {"type": kind, **fields})
