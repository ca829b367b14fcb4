"""The Responses API's streaming events, translated from the chat path's stream as it arrives.

response.created, response.in_progress; once text arrives the message item (output_item.added,
content_part.added) and an output_text.delta per chat content delta; at the end the message's
output_text.done, content_part.done, output_item.done, then each function call (output_item.added,
function_call_arguments.delta / .done, output_item.done: the chat path sends a call once it is
whole, with the end of the reply) and response.completed (or response.incomplete at
max_output_tokens). Every event has a `sequence_number`; an error mid-stream is an `error` event.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator

from axrl.inference.openai.translate import StreamError, chat_deltas, named_sse, new_id

# (chat reply, response id, message item id) -> the Response object (`responses.from_chat`).
Respond = Callable[[dict[str, Any], str, str], dict[str, Any]]
_NOTHING = {"choices": [{"message": {"role": "assistant", "content": None}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}}


async def events(chunks: AsyncIterator[bytes], respond: Respond) -> AsyncIterator[bytes]:
    """The SSE events of the response to the chat stream `chunks` (`respond` builds the Response
    object of a chat reply, as unstreamed)."""
    n = 0
    async for event in _events(chunks, respond):
        yield named_sse(event["type"], {**event, "sequence_number": n})
        n += 1


async def _events(chunks: AsyncIterator[bytes], respond: Respond) -> AsyncIterator[dict[str, Any]]:
    response_id, message_id = new_id("resp"), new_id("msg")
    opening = {**respond(_NOTHING, response_id, message_id), "status": "in_progress", "usage": None}
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    at = {"item_id": message_id, "output_index": 0, "content_index": 0}
    streaming = False  # the message item is open
    try:
        async for kind, value in chat_deltas(chunks):
            if kind == "text":
                if not streaming:
                    streaming = True
                    yield {"type": "response.output_item.added", "output_index": 0, "item": {
                        "type": "message", "id": message_id, "role": "assistant", "status": "in_progress",
                        "content": []}}
                    yield {"type": "response.content_part.added", **at,
                           "part": {"type": "output_text", "text": "", "annotations": []}}
                yield {"type": "response.output_text.delta", **at, "delta": value, "logprobs": []}
            elif kind == "done":
                response = respond(value, response_id, message_id)
                for event in _ending(response):
                    yield event
    except StreamError as e:
        yield {"type": "error", "code": None, "message": str(e), "param": None}


def _ending(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events after the last text delta: the message's end (its text was streamed), each
    function call whole, the response."""
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield from _message_end(index, item)
        else:
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "arguments": "", "status": "in_progress"}}
            yield from _function_call(index, item)
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    yield {"type": f"response.{response['status']}", "response": response}


def _message_end(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    for k, part in enumerate(item["content"]):
        at = {**where, "content_index": k}
        yield {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []}
        yield {"type": "response.content_part.done", **at, "part": part}


def _function_call(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    yield {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]}
    yield {"type": "response.function_call_arguments.done", **where, "name": item["name"],
           "arguments": item["arguments"]}
