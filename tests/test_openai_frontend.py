"""The shared OpenAI front-end (`axrl.inference.openai`) without a server: the stop-string rule,
stream hold-back, the SSE chunks of finished choices, and the two error bodies."""

from __future__ import annotations

import asyncio
import json

import pytest

from axrl.inference.openai.errors import ApiError, bad, openai_error_body, sglang_error_body
from axrl.inference.openai.replies import Envelope, finish_reason
from axrl.inference.openai.stops import cut_at_stop, held_back, parse_stops
from axrl.inference.openai.streaming import Final, sse_stream


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
