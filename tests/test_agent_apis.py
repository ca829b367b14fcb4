"""Anthropic Messages and OpenAI Responses on the proxy's session URLs, driven by the official
`anthropic` and `openai` SDKs: text, a tool round trip that extends the session, streaming equal
to the plain reply, errors naming the field; and the token-level recording of each call."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from agent_util import ScriptedEngine, calculator_policy, open_proxy_session, tiny_engine
from axrl.agents.proxy import ProxyServer
from axrl.inference.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)
SYSTEM = "Use the calculator tool, then reply: The answer is N."
QUESTION = "What is 37 + 58?"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
ANTHROPIC_TOOLS = [{"name": "calculator", "description": "exact arithmetic", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "exact arithmetic",
                    "parameters": SCHEMA}]


def claude(base_url: str, session) -> anthropic.Anthropic:
    # Anthropic's SDK appends /v1/messages to the base URL and sends the key as x-api-key
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=session.api_key, max_retries=0)


def gpt(base_url: str, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=session.api_key, max_retries=0)


def assert_recorded_exactly(session, tok, engine_outputs):
    """Each turn holds the very ids the engine generated (and their logprobs), nothing else."""
    turns = list(session.turns.values())
    assert [t.output_ids for t in turns] == engine_outputs
    (traj,) = session.trajectories(sample_id=0, group_id=0, prompt_id="p")
    assert traj.token_ids.tolist() == turns[-1].stream  # one token stream, the last call's prompt + reply
    trained = traj.loss_mask.astype(bool)
    assert traj.token_ids[trained].tolist() == [i for out in engine_outputs for i in out]
    assert (traj.rollout_logprob[trained] == -0.5).all()


# ---------------------------------------------------------------------------- Anthropic Messages

def test_messages_tool_round_trip_extends_the_session(proxy, tok):
    policy = calculator_policy(tok)
    engine = ScriptedEngine(policy)
    session, base = open_proxy_session(proxy, engine, tok)
    client = claude(base, session)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model="claude-x", max_tokens=64, system=SYSTEM, messages=messages,
                                   tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use" and first.model == "policy"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "37 + 58"}
    (turn,) = session.turns.values()
    assert first.usage.input_tokens == len(turn.prompt_ids) and first.usage.output_tokens == len(turn.output_ids)
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "95"}]}]
    second = client.messages.create(model="claude-x", max_tokens=64, system=SYSTEM, messages=messages,
                                    tools=ANTHROPIC_TOOLS)
    assert second.stop_reason == "end_turn" and second.content[0].text == "The answer is 95."
    # one path: the second call continues the first turn's own token stream
    assert session.turns[2].parent == 1 and session.forks == 0 and session.turns[1].drift_tokens == 0
    assert session.turns[2].prompt_ids[:len(session.turns[1].stream)] == session.turns[1].stream
    assert_recorded_exactly(session, tok, [policy(q.input_ids) for q in engine.requests])


def test_messages_stream_assembles_the_plain_message(proxy, tok):
    engine = tiny_engine(tok)
    try:
        replies = []
        for stream in (False, True):  # two sessions with the same seed: the same sampled tokens
            session, base = open_proxy_session(proxy, engine, tok, seed=7)
            client = claude(base, session)
            kw = dict(model="m", max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                      messages=[{"role": "user", "content": "hi"}],
                      extra_body={"temperature": 0.9})  # the SDK (2.16) no longer types it; the API takes it
            if stream:
                with client.messages.stream(**kw) as events:
                    kinds = [e.type for e in events]
                    replies.append(events.get_final_message())
                assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
            else:
                replies.append(client.messages.create(**kw))
            (turn,) = session.turns.values()
            assert replies[-1].usage.output_tokens == len(turn.output_ids) <= 12
        plain, streamed = (r.model_dump(exclude={"id"}) for r in replies)
        assert streamed == plain and plain["stop_reason"] in ("end_turn", "max_tokens")
    finally:
        engine.shutdown()


def test_messages_stream_sends_tool_use_as_input_json(proxy, tok):
    session, base = open_proxy_session(proxy, ScriptedEngine(calculator_policy(tok)), tok)
    with claude(base, session).messages.stream(model="m", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                               messages=[{"role": "user", "content": QUESTION}]) as events:
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        final = events.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    assert final.content[0].input == {"expression": "37 + 58"}


def test_messages_stop_sequence_and_max_tokens(proxy, tok):
    engine = ScriptedEngine(lambda p: tok.encode("The answer is 95. Done.") + [tok.eos_token_id])
    session, base = open_proxy_session(proxy, engine, tok)
    client = claude(base, session)
    msgs = [{"role": "user", "content": QUESTION}]
    cut = client.messages.create(model="m", max_tokens=64, messages=msgs, stop_sequences=[". D"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == ". D"
    assert cut.content[0].text == "The answer is 95"
    kept = tok.decode(session.turns[1].output_ids)  # only the ids before the stop's last token are recorded
    assert kept.startswith("The answer is 95") and ". D" not in kept
    short = client.messages.create(model="m", max_tokens=3, messages=msgs)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_messages_errors_are_anthropic_shaped_and_name_the_field(proxy, tok):
    session, base = open_proxy_session(proxy, ScriptedEngine(calculator_policy(tok)), tok)
    client = claude(base, session)
    msgs = [{"role": "user", "content": QUESTION}]
    cases = [(dict(max_tokens=8, messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
             (dict(max_tokens=8, messages=msgs, extra_body={"temperature": 1.5}), "temperature"),
             (dict(max_tokens=8, messages=msgs + [{"role": "assistant", "content": "The"}]), "messages[1].role"),
             (dict(max_tokens=8, messages=msgs, tools=[{"input_schema": SCHEMA}]), "tools[0].name"),
             (dict(max_tokens=8, messages=msgs, tools=[{"name": "f", "input_schema": "{}"}]),
              "tools[0].input_schema"),
             (dict(max_tokens=8, messages=msgs, stop_sequences=[""]), "stop_sequences"),
             (dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "image"}]}]),
              "messages[0].content[0]")]
    for kw, field in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="m", **kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(field + ":"), (field, e.value.body)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.post("/v1/messages", body={"model": "m", "messages": msgs}, cast_to=object)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="sk-wrong", max_retries=0).messages.create(
            model="m", max_tokens=8, messages=msgs)
    assert not session.turns and session.state == "open"  # no error recorded a turn or ended the session


# ---------------------------------------------------------------------------- OpenAI Responses

def test_responses_tool_round_trip_extends_the_session(proxy, tok):
    policy = calculator_policy(tok)
    engine = ScriptedEngine(policy)
    session, base = open_proxy_session(proxy, engine, tok)
    client = gpt(base, session)
    items: list = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(model="gpt-x", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS)
    assert first.status == "completed" and first.output_text == ""
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "37 + 58"}
    (turn,) = session.turns.values()
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(turn.prompt_ids), len(turn.output_ids))
    assert first.usage.total_tokens == len(turn.stream)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "95"})
    second = client.responses.create(model="gpt-x", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS)
    assert second.output_text == "The answer is 95." and second.output[0].type == "message"
    assert session.turns[2].parent == 1 and session.forks == 0 and session.turns[1].drift_tokens == 0
    assert_recorded_exactly(session, tok, [policy(q.input_ids) for q in engine.requests])


def test_responses_stream_assembles_the_plain_response(proxy, tok):
    engine = tiny_engine(tok)
    try:
        replies = []
        for stream in (False, True):  # two sessions with the same seed: the same sampled tokens
            session, base = open_proxy_session(proxy, engine, tok, seed=7)
            reply = gpt(base, session).responses.create(model="m", input="hi", max_output_tokens=12,
                                                        temperature=0.9, stream=stream)
            if stream:
                events = list(reply)
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                reply = events[-1].response  # response.completed, or response.incomplete at the limit
                assert events[-1].type == f"response.{reply.status}" and text == reply.output_text
            replies.append(reply)
        plain, streamed = (r.model_dump(exclude={"id", "created_at"}) for r in replies)
        for item in plain["output"] + streamed["output"]:
            item.pop("id")
        assert streamed == plain and plain["usage"]["output_tokens"] <= 12
    finally:
        engine.shutdown()


def test_responses_stream_sends_function_call_arguments(proxy, tok):
    session, base = open_proxy_session(proxy, ScriptedEngine(calculator_policy(tok)), tok)
    kw = dict(model="m", instructions=SYSTEM, input=QUESTION, tools=RESPONSES_TOOLS)
    events = list(gpt(base, session).responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"expression": "37 + 58"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with gpt(base, session).responses.stream(**kw) as stream:  # the SDK's accumulating helper
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {
        "expression": "37 + 58"}


def _text_arrivals(http: httpx.Client, url: str, key: str, body: dict) -> tuple[list[float], str, float]:
    """(arrival of each text delta event, their text, arrival of the stream's end), in seconds
    from the call: Anthropic's text_delta and the Responses output_text.delta events, read raw."""
    start, arrivals, text = time.monotonic(), [], ""
    with http.stream("POST", url, json={**body, "stream": True}, headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            event = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
            delta = event.get("delta")
            piece = delta.get("text") if isinstance(delta, dict) else delta \
                if event.get("type") == "response.output_text.delta" else None
            if piece:
                arrivals.append(time.monotonic() - start)
                text += piece
    return arrivals, text, time.monotonic() - start


def test_both_apis_stream_text_while_it_is_generated(proxy, tok):
    """Messages and Responses streams are the chat stream translated as it arrives: on the real
    engine the first text delta of a 96-token reply comes long before the end, and the deltas add
    up to the recorded reply."""
    engine = tiny_engine(tok)
    http = httpx.Client(timeout=30)
    try:  # a first request warms the engine up: the timings below are of a warm one
        engine.generate_batch([GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4))])
        session, base = open_proxy_session(proxy, engine, tok, max_tokens=96)
        story = [{"role": "user", "content": "Tell me a story."}]
        got = [_text_arrivals(http, f"{base}/messages", session.api_key,
                              {"model": "m", "max_tokens": 96, "messages": story}),
               _text_arrivals(http, f"{base}/responses", session.api_key,
                              {"model": "m", "max_output_tokens": 96, "input": story})]
        for turn, (arrivals, text, end) in zip(session.turns.values(), got):
            assert len(turn.output_ids) >= 64 and text == turn.text
            assert len(arrivals) >= 4 and arrivals[0] < 0.5 * end, (arrivals, end)
    finally:
        http.close()
        engine.shutdown()


def test_responses_errors_name_the_field(proxy, tok):
    session, base = open_proxy_session(proxy, ScriptedEngine(calculator_policy(tok)), tok)
    client = gpt(base, session)
    cases = [(dict(input=[]), "input"),
             (dict(input=[{"type": "reasoning"}]), "input[0].type"),
             (dict(input="hi", tools=[{"type": "web_search"}]), "tools[0].type"),
             (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
             (dict(input="hi", previous_response_id="resp_1"), "previous_response_id"),
             (dict(input=[{"role": "user", "content": 5}]), "input[0].content")]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", **kw)
        assert e.value.body["param"] == field and e.value.body["message"].startswith(field + ":"), e.value.body
    assert not session.turns


def test_the_fast_call_path_answers_as_the_fastapi_routes(proxy, tok):
    """`CallRoutes` (what ProxyServer serves) and the FastAPI routes of record agree on the new
    routes: status and body of replies and errors, with either way of sending the key."""
    import httpx
    from fastapi.testclient import TestClient

    from axrl.agents.proxy.proxy_app import create_app

    session, base = open_proxy_session(proxy, ScriptedEngine(calculator_policy(tok)), tok)
    path = "/sessions/" + base.split("/sessions/")[1]
    msgs = [{"role": "user", "content": QUESTION}]
    cases = [("messages", {"model": "m", "max_tokens": 64, "messages": msgs, "tools": ANTHROPIC_TOOLS}),
             ("messages", {"model": "m", "messages": msgs}), ("messages", b"{not json"),
             ("responses", {"model": "m", "input": QUESTION, "tools": RESPONSES_TOOLS}),
             ("responses", {"model": "m", "input": 3})]
    app = TestClient(create_app(proxy.registry), raise_server_exceptions=False)
    for (route, body), key in zip(cases * 2, [{"x-api-key": session.api_key}] * 5 + [{"x-api-key": "sk-no"}] * 5):
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        fast = httpx.post(f"{base}/{route}", headers=key, **kw)
        slow = app.post(f"{path}/{route}", headers=key, **kw)
        assert fast.status_code == slow.status_code, (route, body)
        assert _strip(fast.json()) == _strip(slow.json()), (route, body)


def _strip(reply: dict) -> dict:
    """A reply without its per-call random ids and times."""
    text = json.dumps(reply)
    for key in ("id", "created_at", "call_id"):
        text = re.sub(rf'"{key}": "?[\w-]+"?', f'"{key}": 0', text)
    return json.loads(text)


# ---------------------------------------------------------------------------- axrl serve

@pytest.fixture(scope="module")
def serve(tok):
    """`axrl serve`'s app over a tiny random-init engine, in process (the SDKs talk to it through
    Starlette's TestClient as their HTTP client)."""
    from fastapi.testclient import TestClient

    from axrl.inference.serve.serve_app import create_app
    from axrl.inference.serve.state import AxrlServer, ServeConfig

    server = AxrlServer(tiny_engine(tok), ServeConfig(model_path="tiny", max_running_requests=8), tok)
    with TestClient(create_app(server)) as http:
        yield http


def test_serve_answers_both_apis_as_its_chat_path(serve):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = serve.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 8,
                                                    "temperature": 0}).json()
    text, usage = chat["choices"][0]["message"]["content"], chat["usage"]
    claude_client = anthropic.Anthropic(base_url="http://testserver", api_key="-", http_client=serve, max_retries=0)
    kw = dict(model="tiny", max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    message = claude_client.messages.create(**kw)
    assert message.content[0].text == text and message.model == "tiny"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (usage["prompt_tokens"],
                                                                         usage["completion_tokens"])
    with claude_client.messages.stream(**kw) as events:
        assert events.get_final_message().model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
    gpt_client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=serve, max_retries=0)
    response = gpt_client.responses.create(model="tiny", input=msgs, max_output_tokens=8, temperature=0)
    assert response.output_text == text and response.usage.total_tokens == usage["total_tokens"]
    assert response.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    events = list(gpt_client.responses.create(model="tiny", input=msgs, max_output_tokens=8, temperature=0,
                                              stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text


def test_serve_streams_both_apis_token_by_token(serve):
    """`axrl serve`'s Messages and Responses streams translate its chat stream chunk by chunk:
    many text deltas, adding up to the chat reply."""
    msgs = [{"role": "user", "content": "Tell me a story."}]
    chat = serve.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 200,
                                                    "temperature": 0}).json()
    text = chat["choices"][0]["message"]["content"]
    claude_client = anthropic.Anthropic(base_url="http://testserver", api_key="-", http_client=serve, max_retries=0)
    with claude_client.messages.stream(model="tiny", max_tokens=200, messages=msgs,
                                       extra_body={"temperature": 0}) as events:
        deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    gpt_client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=serve, max_retries=0)
    items = [e.delta for e in gpt_client.responses.create(model="tiny", input=msgs, max_output_tokens=200,
                                                          temperature=0, stream=True)
             if e.type == "response.output_text.delta"]
    for pieces in (deltas, items):
        assert len(pieces) >= 3 and "".join(pieces) == text  # unstreamed: one delta


def test_serve_errors_are_each_apis_own(serve):
    claude_client = anthropic.Anthropic(base_url="http://testserver", api_key="-", http_client=serve, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        claude_client.messages.create(model="other", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "model" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        claude_client.messages.create(model="tiny", max_tokens=8, messages=[])
    gpt_client = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=serve, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        gpt_client.responses.create(model="tiny", input="x", temperature=3)
    assert e.value.body["param"] == "temperature"


# ---------------------------------------------------------------------------- the example agents

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"anthropic": "examples/agents/calculator_agent_anthropic.py",
            "responses": "examples/agents/calculator_agent_responses.py"}


@pytest.mark.parametrize("api", sorted(EXAMPLES))
def test_the_example_agents_run_unmodified_and_are_scored(tok, api):
    """Each example agent as a process per episode (the SDK only, configured by the environment
    AxRL sets), scored by the calculator verifier: two calls, one token stream."""
    import asyncio

    from axrl.agents.tasks import TASKS
    from axrl.rollout.blackbox import AgentSettings, BlackBoxPlayer, load_callable

    source = (ROOT / EXAMPLES[api]).read_text()
    assert "import axrl" not in source and "from axrl" not in source
    verifier = load_callable(f"{ROOT / 'examples/agents/calculator_reward.py'}:score", "agent.verifier")
    engine = ScriptedEngine(calculator_policy(tok))
    sampling = SamplingParams(max_new_tokens=48, stop_token_ids=tok.stop_token_ids, seed=11)
    with ProxyServer(tok) as proxy:
        player = BlackBoxPlayer(AgentSettings(command=["python", str(ROOT / EXAMPLES[api])], verifier=verifier),
                                proxy, max_context_len=512)
        traj = asyncio.run(player.play(engine, sample_id=3, group_id=1, prompt=TASKS["calculator"]().prompt(0, 4),
                                       sampling=sampling, return_routing=False))
    assert traj.status == "ok", traj.error
    assert traj.reward == 1.0 and traj.num_turns == 2 and not traj.forks and traj.drift_tokens == 0
    first, second = engine.requests
    assert second.input_ids[:len(first.input_ids)] == first.input_ids
    assert traj.token_ids.tolist() == second.input_ids + calculator_policy(tok)(second.input_ids)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("api", sorted(EXAMPLES))
def test_axrl_train_with_each_example_config(tmp_path, api):
    """`axrl train examples/blackbox_<api>.yaml`, shortened: two steps, every session recorded."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / f"examples/blackbox_{api}.yaml"), "--run-dir",
           str(run), "--set", "steps=2", "--set", "warmup.steps=4", "--set", "eval.every=0",
           "--set", "data.prompts_per_step=2", "--set", "rollout.group_size=2", "--set", "model.preset=micro-moe"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["sessions"] == 4 and r["failed"] == 0 for r in rows), rows


# ---------------------------------------------------------------------------- the translations alone

def test_messages_translate_into_the_chat_form():
    from axrl.inference.openai.anthropic_messages import to_chat

    chat = to_chat({"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be exact."}],
                    "stop_sequences": ["\n\n"], "tool_choice": {"type": "any"}, "tools": ANTHROPIC_TOOLS,
                    "messages": [{"role": "user", "content": "What is 2 + 2?"},
                                 {"role": "assistant", "content": [
                                     {"type": "text", "text": "Computing."},
                                     {"type": "tool_use", "id": "t1", "name": "calculator",
                                      "input": {"expression": "2 + 2"}}]},
                                 {"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "4"}]},
                                     {"type": "text", "text": "And now?"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Computing.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "4"}, {"role": "user", "content": "And now?"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "calculator", "parameters": SCHEMA,
                                                                "description": "exact arithmetic"}}]
    assert (chat["max_tokens"], chat["stop"], chat["tool_choice"]) == (9, ["\n\n"], "required")


def test_responses_input_items_translate_into_the_chat_form():
    from axrl.inference.openai.responses import to_chat

    chat = to_chat({"instructions": "Be exact.", "max_output_tokens": 5, "tools": RESPONSES_TOOLS, "input": [
        {"type": "message", "role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Computing."}]},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expression": "2+2"}'},
        {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": '{"expression": "1"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "function_call_output", "call_id": "c2", "output": "1"}]})
    calls = [c["id"] for c in chat["messages"][3]["tool_calls"]]
    assert [m["role"] for m in chat["messages"]] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert chat["messages"][3]["content"] == "Computing." and calls == ["c1", "c2"]
    assert chat["max_tokens"] == 5 and chat["tools"][0]["function"]["parameters"] == SCHEMA
