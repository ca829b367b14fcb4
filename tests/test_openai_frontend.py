"""The shared OpenAI front-end (`axrl.inference.openai`) without a server: the stop-string rule,
stream hold-back, the SSE chunks of finished choices, following n streams at once, the Messages and
Responses streams translated from the chat stream as it arrives, and the two error bodies."""

from __future__ import annotations

import asyncio
import json

import pytest

from axrl.inference.openai.errors import ApiError, bad, openai_error_body, sglang_error_body
from axrl.inference.openai.replies import Envelope, finish_reason
from axrl.inference.openai import anthropic_messages, responses
from axrl.inference.openai.stops import cut_at_stop, held_back, parse_stops, sendable
from axrl.inference.openai.streaming import Final, merge, sse_stream


def _chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_the_cut_is_at_the_stop_completed_first():
    ids = [ord(c) for c in "xxabcdyy"]
    # "abcd" starts first but "c" is completed first: the reply ends before "c"
    cut = cut_at_stop(ids, _chars, ["abcd", "c"])
    assert (cut.keep, cut.text, cut.matched) == (4, "xxab", "c")
    assert cut_at_stop(ids, _chars, ["zz"]) is None and cut_at_stop(ids, _chars, []) is None


def test_stop_validation_names_the_field_and_bounds_the_count():
    assert parse_stops({"stop": "a"}) == ["a"] and parse_stops({}) == []
    with pytest.raises(ApiError) as e:
        parse_stops({"stop": ["a", "b", "c", "d", "e"]}, limit=4)
    assert e.value.param == "stop" and e.value.status == 400
    assert parse_stops({"stop": ["a", "b", "c", "d", "e"]}) == ["a", "b", "c", "d", "e"]
    with pytest.raises(ApiError):
        parse_stops({"stop": [""]})


def test_hold_back_keeps_possible_stops_and_tool_calls():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["world"]) == 0
    assert held_back("ok <tool_call>{", [], hold_from="<tool_call>") == len("<tool_call>{")
    assert held_back("ok <tool", [], hold_from="<tool_call>") == len("<tool")
    assert held_back("caf\ufffd", []) == 1


def test_sendable_text_stops_at_a_stop_string_and_holds_tool_calls():
    assert sendable("The answer is 95. Done", [". D"]) == "The answer is 95"   # nothing after a stop
    assert sendable("hello wor", ["world"]) == "hello "
    assert sendable("ok \n<tool", [], "<tool_call>") == "ok"   # the content before a call is stripped
    assert sendable("ok <tool_call>{", [], "<tool_call>") == "ok"
    assert sendable("ok \n", []) == "ok \n"                   # without tools whitespace is text


def test_merge_yields_each_stream_as_it_arrives_and_closes_all():
    closed = []

    async def ticks(name: str, delays: list[float]):
        try:
            for d in delays:
                await asyncio.sleep(d)
                yield name
        finally:
            closed.append(name)

    async def run(stop_after: int | None):
        out = []
        async for k, item in merge([ticks("a", [0.0, 0.2]), ticks("b", [0.05, 0.05])]):
            out.append((k, item))
            if stop_after is not None and len(out) == stop_after:
                break
        return out

    assert asyncio.run(run(None)) == [(0, "a"), (1, "b"), (1, "b"), (0, "a")]
    closed.clear()
    assert asyncio.run(run(1)) == [(0, "a")] and sorted(closed) == ["a", "b"]  # leaving early closes both


def _gated_chat(seen: asyncio.Event):
    """A chat path whose stream sends "Hel", then waits until the consumer has passed it on: a
    translation that waited for the whole reply would never finish."""
    async def progress():
        yield ["Hel"]
        await asyncio.wait_for(seen.wait(), 5)
        yield [Final("Hello", "stop", extras={"matched_stop": None})]

    async def chat(body):
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return sse_stream(Envelope(chat=True, model="m"), 1, progress(), lambda: usage)

    return chat


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_api_streams_translate_the_chat_stream_as_it_arrives(api):
    async def run():
        seen, events = asyncio.Event(), []
        if api == "messages":
            body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            stream = await anthropic_messages.create_message(body, _gated_chat(seen), "m")
        else:
            stream = await responses.create_response({"model": "m", "input": "hi", "stream": True}, _gated_chat(seen))
        async for raw in stream:
            event = json.loads(raw.decode().split("data: ", 1)[1])
            events.append(event)
            if event["type"] in ("content_block_delta", "response.output_text.delta"):
                seen.set()
        return events

    events = asyncio.run(run())
    deltas = [e["delta"] for e in events if e["type"] in ("content_block_delta", "response.output_text.delta")]
    texts = [d["text"] if isinstance(d, dict) else d for d in deltas]
    assert texts == ["Hel", "lo"]
    if api == "messages":
        end = next(e for e in events if e["type"] == "message_delta")
        assert end["delta"]["stop_reason"] == "end_turn" and end["usage"] == {"input_tokens": 3, "output_tokens": 2}
        assert events[-1]["type"] == "message_stop"
    else:
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and final["output"][0]["content"][0]["text"] == "Hello"
        assert final["output"][0]["id"] == events[2]["item"]["id"] and final["usage"]["total_tokens"] == 5


def test_finished_choices_stream_as_openai_chunks():
    async def once():
        yield [Final("hi", "stop"), Final(None, "tool_calls", [{"id": "c", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}])]

    async def collect():
        return [x async for x in sse_stream(Envelope(chat=True, model="m"), 2, once(), lambda: {"total_tokens": 3})]

    raw = asyncio.run(collect())
    assert raw[-1] == b"data: [DONE]\n\n"
    events = [json.loads(r[6:]) for r in raw[:-1]]
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == "m" for e in events)
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"])
              for e in events if e["choices"]]
    assert deltas[:2] == [(0, {"content": "", "role": "assistant"}, None), (1, {"content": "", "role": "assistant"}, None)]
    assert (0, {"content": "hi"}, None) in deltas and (0, {}, "stop") in deltas and deltas[-1] == (1, {}, "tool_calls")
    assert events[-1] == {**events[-1], "choices": [], "usage": {"total_tokens": 3}}


def test_finish_reasons_and_error_bodies():
    assert finish_reason("stop", tool_calls=True) == "tool_calls"
    assert finish_reason("abort", tool_calls=False) == "abort"
    assert finish_reason("abort", tool_calls=False, abort="stop") == "stop"
    err = bad("temperature", "must be a number")
    assert openai_error_body(err) == {"error": {"message": "temperature: must be a number",
                                                "type": "invalid_request_error", "param": "temperature", "code": None}}
    assert sglang_error_body("model: no", 404) == {"object": "error", "message": "model: no", "type": "NotFoundError",
                                                   "code": 404}
    assert ApiError(429, "later", retry_after=0.2).headers == {"Retry-After": "1"}
