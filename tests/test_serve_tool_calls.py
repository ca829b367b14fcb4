"""`axrl serve`'s OpenAI chat endpoint on a Qwen3-family directory (the template of
tests/templates/qwen3.jinja, which writes Qwen3's empty think block before calls), read with the
official `openai` SDK: a reply with two calls comes back as two `tool_calls`, a call after a
`<think>` block as one, and the `<think>` block's text comes back as `message.reasoning_content`
(as vLLM and SGLang return it), streamed too. The engine's reply is scripted (a random-init model writes no calls):
the server's own app, tokenizer and reply parsing are what is tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl.inference.protocol import GenerateResult
from axrl.inference.serve.serve_app import create_app
from axrl.inference.serve.state import ServeConfig, build_server
from template_models import CONVENTIONS, write_convention_dir

import openai  # noqa: E402  (the test extra installs it: a broken install must fail, not skip)
from fastapi.testclient import TestClient  # noqa: E402

torch.set_num_threads(1)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_convention_dir(tmp_path_factory.mktemp("qwen3") / "model", CONVENTIONS["qwen3"])
    server = build_server(ServeConfig(model_path=str(model_dir)))
    script: list[str] = []

    async def follow(requests, is_disconnected):  # the engine's reply, scripted: token by token, then final
        tok = server.tokenizer
        ids = tok.encode(script[0])
        for i in range(1, len(ids) + 1):
            yield [(ids[:i], [0.0] * i) for _ in requests]
        yield [GenerateResult(rid=r.rid, output_ids=tok.encode(script[0]) + [tok.eos_token_id], output_logprobs=[],
                              routed_experts=None, finish_reason={"type": "stop", "matched": tok.eos_token_id},
                              weight_version=0, prompt_tokens=len(r.input_ids)) for r in requests]

    server.follow = follow  # type: ignore[method-assign]
    http = TestClient(create_app(server))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    yield client, script, Path(model_dir).name
    http.close()
    server.engine.shutdown() if hasattr(server.engine, "shutdown") else None


def _ask(served, reply: str):
    client, script, model = served
    script[:] = [reply]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "37 + 58 and 2 * 3?"}],
                                          tools=TOOLS, max_tokens=64).choices[0]


def test_two_calls_come_back_as_two_tool_calls(served):
    # as the Qwen3 template writes a last turn: an empty think block, then the calls
    choice = _ask(served, "<think>\n\n</think>\n\n" + CALL.format("37 + 58") + "\n" + CALL.format("2 * 3"))
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and len(calls) == 2
    assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "37 + 58"}, {"expression": "2 * 3"}]


def test_a_call_after_reasoning_comes_back_as_one_tool_call(served):
    choice = _ask(served, "<think>\nI should add them.\n</think>\n\n" + CALL.format("37 + 58"))
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "calculator" and json.loads(calls[0].function.arguments) == {"expression": "37 + 58"}


def test_a_call_inside_the_reasoning_is_no_call(served):
    choice = _ask(served, "<think>\nmaybe " + CALL.format("1 + 1") + "\n</think>\n\nThe answer is 2.")
    assert choice.finish_reason == "stop" and not choice.message.tool_calls


def test_reasoning_comes_back_as_reasoning_content(served):
    """The `<think>` block is split out of `content` into `message.reasoning_content`, with calls
    and without; Qwen3's empty think block is no reasoning."""
    choice = _ask(served, "<think>\nI should add them.\n</think>\n\n" + CALL.format("37 + 58"))
    assert choice.message.reasoning_content == "I should add them." and not choice.message.content
    assert len(choice.message.tool_calls) == 1
    choice = _ask(served, "<think>\nadd\n</think>\n\nThe answer is 95.")
    assert (choice.message.reasoning_content, choice.message.content) == ("add", "The answer is 95.")
    choice = _ask(served, "<think>\n\n</think>\n\nThe answer is 95.")
    assert (choice.message.reasoning_content, choice.message.content) == (None, "The answer is 95.")
    choice = _ask(served, "The answer is 95.")
    assert (choice.message.reasoning_content, choice.message.content) == (None, "The answer is 95.")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_streamed_reasoning_comes_as_reasoning_content_deltas(served, tools):
    """Streamed token by token: the reasoning arrives in `delta.reasoning_content`, never a tag of
    it in `delta.content`, and the deltas add up to the non-streamed reply's fields."""
    client, script, model = served
    script[:] = ["<think>\nI add 37 and 58.\n</think>\n\nThe answer is 95."]
    kw = {"tools": tools} if tools else {}
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "37 + 58?"}],
                                            max_tokens=64, stream=True, **kw)
    thought, content = [], []
    for chunk in stream:
        for c in chunk.choices:
            thought.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    assert "".join(thought) == "I add 37 and 58." and "".join(content) == "The answer is 95."
    assert sum(1 for t in thought if t) > 1  # streamed as it came, not in one piece at the end
    assert not any("think>" in c or "<" in c for c in content)


def test_every_streamed_prefix_of_the_reasoning_split_is_a_prefix_of_the_final_one(tmp_path):
    """Character by character (a tag arriving in pieces, as with a tokenizer that splits it), the
    streamed reasoning and content only ever grow into the finished reply's split: what was sent
    never has to be taken back."""
    from axrl.inference.openai.replies import reasoning_of, streamed_reasoning
    from axrl.tokenizer import load_tokenizer

    tok = load_tokenizer(write_convention_dir(tmp_path / "qwen3", CONVENTIONS["qwen3"]))
    reply = "<think>\nI add 37 and 58.\n</think>\n\nThe answer is 95."
    reasoning, content = reasoning_of(tok, reply)
    assert (reasoning, content) == ("I add 37 and 58.", "The answer is 95.")
    for i in range(len(reply) + 1):
        thought, text = streamed_reasoning(tok, reply[:i])
        assert reasoning.startswith(thought) and content.startswith(text), (i, thought, text)
        assert "<" not in text
