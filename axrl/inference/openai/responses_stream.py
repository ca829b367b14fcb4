"""The Responses API's streaming events of a finished response.

response.created, response.in_progress, then per output item: output_item.added, its content
(a message: content_part.added, output_text.delta / .done, content_part.done; a function call:
function_call_arguments.delta / .done), output_item.done; then response.completed (or
response.incomplete at max_output_tokens). Every event has a `sequence_number`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

from axrl.inference.openai.translate import named_sse


async def events(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """The SSE events of `response` (its items are sent whole: one delta each)."""
    for n, event in enumerate(_events(response)):
        yield named_sse(event["type"], {**event, "sequence_number": n})


def _events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    opening = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    for index, item in enumerate(response["output"]):
        yield {"type": "response.output_item.added", "output_index": index, "item": _opened(item)}
        yield from (_message(index, item) if item["type"] == "message" else _function_call(index, item))
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    yield {"type": f"response.{response['status']}", "response": response}


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is announced: in progress, nothing generated yet."""
    empty = {"content": []} if item["type"] == "message" else {"arguments": ""}
    return {**item, **empty, "status": "in_progress"}


def _message(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    for k, part in enumerate(item["content"]):
        at = {**where, "content_index": k}
        yield {"type": "response.content_part.added", **at, "part": {**part, "text": ""}}
        yield {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []}
        yield {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []}
        yield {"type": "response.content_part.done", **at, "part": part}


def _function_call(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    yield {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]}
    yield {"type": "response.function_call_arguments.done", **where, "name": item["name"],
           "arguments": item["arguments"]}
