"""OpenAI's Responses API (`POST /v1/responses`) over the chat path (see `translate`).

Supported: `instructions`, `input` as a string or a list of items — messages (string or
input_text / output_text parts), `function_call` and `function_call_output` — `tools` (type
function: name, description, parameters), `tool_choice`, `max_output_tokens`, `temperature`,
`top_p`, `stream` (the Responses events, translated from the chat path's stream as its tokens
arrive: an `output_text.delta` per chat content delta). Stateless: the whole
conversation comes in `input` (`previous_response_id` is refused, `store` ignored). Replies carry
`status` (completed, or incomplete at max_output_tokens) and `usage` (input / output / total
tokens). Errors are OpenAI's error object.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from axrl.inference.openai import schema
from axrl.inference.openai.errors import bad
from axrl.inference.openai.responses_stream import events
from axrl.inference.openai.translate import ChatFn, function_tool, new_id, run_chat, text_parts, tool_call

FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                    "top_p", "stream", "parallel_tool_calls", "store", "metadata", "user", "previous_response_id",
                    "truncation"})
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}
_TEXT_PARTS = ("input_text", "output_text", "text")
Reply = dict[str, Any] | AsyncIterator[bytes]


async def create_response(body: Any, chat: ChatFn, model: str | None = None) -> Reply:
    """`POST /v1/responses`: the response (or its SSE events) of `chat` run on the translated
    body; `model` names the served model in replies (None: the request's)."""
    request = to_chat(body)
    if body.get("stream"):
        name = model or body.get("model") or ""
        return events(await run_chat(chat, request, _RENAMES, stream=True),
                      lambda reply, response_id, message_id: from_chat(reply, body, name, response_id, message_id))
    reply = await run_chat(chat, request, _RENAMES)
    return from_chat(reply, body, model or body.get("model") or reply.get("model", ""))


# ---------------------------------------------------------------------------- request

def to_chat(body: Any) -> dict[str, Any]:
    """The OpenAI chat body of a Responses request (400s name the Responses field)."""
    body = schema.check_body(body, FIELDS, "/v1/responses")
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id", "responses are not stored: send the whole conversation in input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"messages": system + _items(body.get("input"))}
    schema.number(body, "temperature", 0.0, 2.0)  # OpenAI's ranges, whatever the backend would take
    schema.number(body, "top_p", 0.0, 1.0)
    chat.update({k: body[k] for k in ("model", "temperature", "top_p") if body.get(k) is not None})
    chat["max_tokens"] = schema.integer(body, "max_output_tokens", 1, 1 << 20)
    if chat["max_tokens"] is None:
        del chat["max_tokens"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("tools", "must be a list of tool definitions")
        chat["tools"] = [_tool(i, t) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return chat


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad(f"tools[{i}].type", f"only function tools are supported, got {tool.get('type')!r}")
    return function_tool(f"tools[{i}]", tool, "parameters")


def _tool_choice(choice: Any) -> Any:
    """The Responses tool_choice as chat's (the strings are the same; a function names itself)."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice", f"must be 'auto', 'none', 'required' or {{type: function, name}}, got {choice!r}")


def _items(items: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: function_call items join the assistant message before them (one
    model reply: its text and its calls), function_call_output items are `tool` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        field = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{field}.role", f"must be user, assistant, system or developer, got {role!r}")
            text = text_parts(f"{field}.content", item.get("content"), _TEXT_PARTS)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            _function_call(out, field, item)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{field}.call_id", "must be the call_id of a function_call")
            output = text_parts(f"{field}.output", item.get("output"), _TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise bad(f"{field}.type", f"must be message, function_call or function_call_output, got {kind!r}")
    return out


def _function_call(out: list[dict[str, Any]], field: str, item: dict[str, Any]) -> None:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
        raise bad(field, "a function_call needs a string name and string arguments (JSON)")
    call = tool_call(str(item.get("call_id", "")), item["name"], item["arguments"])
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": None})
    out[-1].setdefault("tool_calls", []).append(call)


# ---------------------------------------------------------------------------- reply

def from_chat(reply: dict[str, Any], body: dict[str, Any], model: str, response_id: str | None = None,
              message_id: str | None = None) -> dict[str, Any]:
    """The Response object of a chat reply: a message item (its text), function_call items (the
    ids: fresh unless given — a stream announces them before the end)."""
    choice = reply["choices"][0]
    message, truncated = choice["message"], choice["finish_reason"] == "length"
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": message_id or new_id("msg"), "role": "assistant",
                       "status": "incomplete" if truncated else "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    output += [{"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": "completed"}
               for c in message.get("tool_calls") or []]
    usage = reply["usage"]
    return {"id": response_id or new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if truncated else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None, "error": None,
            "model": model, "output": output, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}
