"""Token-level stitching in the recording proxy with a reasoning template (Qwen3-style: the
`<think>…</think>` of an assistant turn is kept only after the last user message), driven by the
official `openai` SDK: a session stays one sample, its drift is recorded with turns and spans, and
only an edited history or changed tools fork it (with that cause)."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import openai
import pytest

from agent_util import ScriptedEngine
from axrl.agents.proxy import ProxyServer, SessionPolicy, engine_submit
from axrl.agents.proxy.session import HISTORY_EDITED, N_CHOICES, TEMPLATE_UNSTABLE, TOOLS_CHANGED
from axrl.agents.proxy.stitch import appended_text, drift_spans, render
from axrl.inference.protocol import SamplingParams
from axrl.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)

# The default template's ChatML and tool format, plus Qwen3's reasoning rule: an assistant turn
# after the last user message renders "<think>\nR\n</think>\n\n" + content, an earlier one the
# content only.
REASONING_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not (tools and loop.first) %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set reasoning = '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query and reasoning %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": ' + fn.name | tojson + ', "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "exact arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "Think, use the calculator tool, then reply: The answer is N."}


def with_template(path, template: str) -> Tokenizer:
    """The default tokenizer with ``template``, loaded from a model-style directory at ``path``."""
    Tokenizer.default().save(path)
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return with_template(tmp_path_factory.mktemp("reasoning-tokenizer"), REASONING_TEMPLATE)


def reasoning_policy(tok: Tokenizer):
    """A perfect calculator that thinks first: for the last question a tool call, once the tool
    answered it "The answer is N.", each after a <think> block."""
    def reply(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        question = text[text.rindex("What is"):]
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", question)
        expression = re.findall(r"What is (.*?)\?", question)[0]
        if results:
            out = f"<think>\nThe tool says {expression} = {results[-1]}.\n</think>\n\nThe answer is {results[-1]}."
        else:
            out = (f"<think>\nI should compute {expression} with the tool.\n</think>\n\n<tool_call>\n"
                   f'{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>')
        return tok.encode(out) + [tok.eos_token_id]
    return reply


@pytest.fixture()
def session(tok):
    with ProxyServer(tok, model_name="policy") as proxy:
        engine = ScriptedEngine(reasoning_policy(tok))
        sampling = SamplingParams(max_new_tokens=96, stop_token_ids=tok.stop_token_ids)
        s = proxy.open_session(engine_submit(engine), SessionPolicy(sampling, max_tokens=96), max_context_len=2048)
        client = openai.OpenAI(base_url=proxy.base_url(s), api_key=s.api_key, max_retries=0)
        yield s, client, engine, proxy


def solve(client, messages: list[dict], tools=TOOLS) -> list[dict]:
    """An SDK agent loop: call, run the calculator on each tool call, until a plain answer."""
    messages = list(messages)
    while True:
        msg = client.chat.completions.create(model="policy", messages=messages, tools=tools).choices[0].message
        messages.append(msg.model_dump())  # null fields (refusal, audio, ...) included, as SDK users do
        if not msg.tool_calls:
            return messages
        for call in msg.tool_calls:
            value = eval(json.loads(call.function.arguments)["expression"])  # noqa: S307 — the test's own text
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})


def test_the_template_drops_earlier_reasoning(tok):
    """The premise: once a new user message follows, the re-rendering is no text extension."""
    first = [SYSTEM, {"role": "user", "content": "What is 1 + 1?"},
             {"role": "assistant", "content": "<think>\nadd\n</think>\n\nThe answer is 2."}]
    more = first + [{"role": "user", "content": "What is 2 + 2?"}]
    whole, prefix = render(tok, more, TOOLS, generation=True), render(tok, first, TOOLS, generation=False)
    assert "<think>\nadd" in prefix and "<think>" not in whole and not whole.startswith(prefix)
    # the appended messages are still found: exactly the tail of the whole rendering
    assert appended_text(tok, more, 3, TOOLS, whole) == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_drift_spans_by_message_with_insertions_and_a_cost_cap(monkeypatch):
    from axrl.agents.proxy import stitch

    A = 0  # an anchor (a special token between messages)
    assert not drift_spans([1, 2, A, 3], [1, 2, A, 3], anchors={A})
    # a token the stream has and the rendering lacks, and one the rendering has and the stream lacks
    d = drift_spans([1, 9, 2, A, 3, 4], [1, 2, A, 3, 5, 4], anchors={A})
    assert d.spans == ((1, 2), (5, 6)) and d.tokens == 2  # the insertion marks the token it goes before
    assert drift_spans([1, 5, 6, 7, 2], [1, 8, 6, 9, 2]).spans == ((1, 2), (3, 4))
    monkeypatch.setattr(stitch, "MAX_DIFF_CELLS", 0)  # too long to diff token by token: one span
    d = drift_spans([1, 5, 6, 7, 2], [1, 8, 6, 9, 2])
    assert d.spans == ((1, 4),) and d.tokens == 3


def test_a_reasoning_session_is_one_sample_with_its_drift(session, tok):
    s, client, engine, _ = session
    messages = solve(client, [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}])
    messages = solve(client, messages + [{"role": "user", "content": "What is 6 * 7?"}])
    assert [m["content"] for m in messages if m["role"] == "assistant" and not m.get("tool_calls")] == [
        "<think>\nThe tool says 37 + 58 = 95.\n</think>\n\nThe answer is 95.",
        "<think>\nThe tool says 6 * 7 = 42.\n</think>\n\nThe answer is 42."]
    # four calls, each continuing the previous one: one path, no fork
    assert [(t.index, t.parent, t.fork_cause) for t in s.turns.values()] == [
        (1, None, ""), (2, 1, ""), (3, 2, ""), (4, 3, "")]
    (traj,) = s.trajectories(sample_id=3, group_id=1, prompt_id="q")
    # the sample's drift is its last prompt's (the only one computed: the calls never wait for it)
    assert s.forks == 0 and [(e.kind, e.turn) for e in s.events] == [("drift", 4)]
    assert traj.fork_of == -1 and traj.fork_cause == "" and traj.num_turns == 4
    # every prompt the engine got is the previous stream + the new messages: the generated ids
    # (with their reasoning) are what the model saw and what is trained
    for t, request in zip(s.turns.values(), engine.requests):
        assert request.input_ids == t.prompt_ids
        if t.parent is not None:
            assert t.prompt_ids[:len(s.turns[t.parent].stream)] == s.turns[t.parent].stream
    generated = [i for t in s.turns.values() for i in t.output_ids]
    assert traj.token_ids[traj.loss_mask == 1].tolist() == generated
    assert traj.token_ids.tolist() == s.turns[4].stream
    # the drift: the reasoning of turns 1 and 2, which the template drops once "What is 6 * 7?"
    # follows; turn 3 is after the last user message and keeps its reasoning
    rendered = tok.apply_chat_template(messages[:-1], tools=TOOLS, add_generation_prompt=True)
    assert traj.token_ids.tolist()[:len(s.turns[4].prompt_ids)] != rendered
    assert traj.drift_spans and traj.drift_tokens == drift_spans(s.turns[4].prompt_ids, rendered).tokens
    # each span lies (but for a token the diff may shift across a boundary) in one turn
    assert [int(np.bincount(traj.turn[a:b]).argmax()) for a, b in traj.drift_spans] == [1, 2]
    text = "".join(tok.decode(traj.token_ids[a:b].tolist()) for a, b in traj.drift_spans)
    assert "I should compute 37 + 58" in text and "The tool says 37 + 58 = 95" in text
    assert "6 * 7" not in text
    # outside the spans the sample is the template's rendering
    keep = np.ones(len(s.turns[4].prompt_ids), bool)
    for a, b in traj.drift_spans:
        keep[a:b] = False
    assert tok.decode(traj.token_ids[:len(keep)][keep].tolist()) == tok.decode(rendered)
    assert "turn 1" in s.events[-1].detail and "turn 2" in s.events[-1].detail


def test_an_agent_that_drops_the_reasoning_still_continues(session, tok):
    """Agents often keep only the answer of a reply: the same turn, its reasoning kept (drift)."""
    s, client, _, _ = session
    question = [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}]
    msg = client.chat.completions.create(model="policy", messages=question, tools=TOOLS).choices[0].message
    kept = msg.model_dump()
    kept["content"] = msg.content.split("</think>")[-1]  # "": only the tool call is left
    messages = question + [kept, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "95"}]
    client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert [(t.index, t.parent, t.fork_cause) for t in s.turns.values()] == [(1, None, ""), (2, 1, "")]
    (traj,) = s.trajectories(sample_id=0, group_id=0, prompt_id="q")
    (a, b), = traj.drift_spans
    assert "<think>\nI should compute 37 + 58" in tok.decode(traj.token_ids[a:b].tolist())
    assert traj.token_ids.tolist() == s.turns[2].stream


def test_an_edited_history_forks_with_its_cause(session):
    s, client, _, _ = session
    messages = solve(client, [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}])
    # the agent rewrites its first question and carries on from there
    edited = [dict(m) for m in messages] + [{"role": "user", "content": "What is 2 + 2?"}]
    edited[1]["content"] = "What is 37 + 58? Please."
    client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
    assert [(t.index, t.parent, t.fork_cause) for t in s.turns.values()] == [
        (1, None, ""), (2, 1, ""), (3, None, HISTORY_EDITED)]
    assert [(e.kind, e.cause) for e in s.events] == [("fork", HISTORY_EDITED)]
    primary, fork = s.trajectories(sample_id=5, group_id=1, prompt_id="q")
    assert primary.info["turns"] == [3] and primary.fork_cause == "" and primary.fork_of == -1
    assert fork.info["turns"] == [1, 2] and fork.fork_cause == HISTORY_EDITED and fork.fork_of == 5


def test_changed_tools_fork_with_their_cause(session):
    s, client, _, _ = session
    messages = solve(client, [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}])
    more_tools = TOOLS + [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    # the same conversation, extended, under another tool list: a new root (the tool block changed)
    client.chat.completions.create(model="policy", messages=messages + [{"role": "user", "content": "What is 1 + 2?"}],
                                   tools=more_tools)
    assert [(t.index, t.parent, t.fork_cause) for t in s.turns.values()] == [
        (1, None, ""), (2, 1, ""), (3, None, TOOLS_CHANGED)]
    assert '"search"' in s.tokenizer.decode(s.turns[3].prompt_ids)
    primary, fork = s.trajectories(sample_id=5, group_id=1, prompt_id="q")
    assert (primary.info["turns"], fork.info["turns"], fork.fork_cause) == ([3], [1, 2], TOOLS_CHANGED)


def test_n_choices_fork_as_n_and_a_retry_as_an_edit(session):
    s, client, _, _ = session
    question = [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}]
    assert len(client.chat.completions.create(model="policy", messages=question, tools=TOOLS, n=2).choices) == 2
    client.chat.completions.create(model="policy", messages=question, tools=TOOLS)  # the agent asks again
    assert [t.fork_cause for t in s.turns.values()] == ["", N_CHOICES, HISTORY_EDITED]
    paths = s.trajectories(sample_id=0, group_id=0, prompt_id="q")
    # the primary is the retry; the second choice is a path for n > 1, the first one's path is
    # there because the agent asked again
    assert [(p.info["turns"], p.fork_cause) for p in paths] == [([3], ""), ([2], N_CHOICES), ([1], HISTORY_EDITED)]


def test_the_step_record_keeps_fork_causes_and_drift(session):
    """The session columns of a step record (/samples/fork_cause, /tokens/drift)."""
    from axrl.runtime.recording.builders import _session_columns

    s, client, _, _ = session
    messages = solve(client, [SYSTEM, {"role": "user", "content": "What is 37 + 58?"}])
    solve(client, messages + [{"role": "user", "content": "What is 6 * 7?"}])
    edited = [SYSTEM, {"role": "user", "content": "What is 37 + 58? Please."}]
    client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)
    trajs = s.trajectories(sample_id=0, group_id=0, prompt_id="q")
    cols = _session_columns(trajs)
    assert cols["fork_cause"] == ["", HISTORY_EDITED]
    drift = np.split(cols["drift"], np.cumsum([t.num_tokens for t in trajs])[:-1])
    assert drift[0].sum() == 0 and drift[1].sum() > 0  # the long path drifted, the edited root did not
    assert set(trajs[1].turn[drift[1] == 1].tolist()) == {1, 2}
    assert drift[1].sum() == sum(b - a for a, b in trajs[1].drift_spans)


def test_trajectory_intake_needs_the_agent_key(session, tok):
    from axrl.agents.proxy.trajectories import AgentService
    from axrl.rollout.pool import TrajectoryPool

    s, _, _, proxy = session
    pool = TrajectoryPool(1)
    proxy.registry.service = AgentService(tok, pool.add, current_version=lambda: 0, max_context_len=256)
    ids = tok.encode("What is 1 + 1? 2")
    body = {"group_id": 1, "token_ids": ids, "loss_mask": [0] * (len(ids) - 1) + [1],
            "logprobs": [None] * (len(ids) - 1) + [-0.1], "reward": 1.0}
    url = f"{proxy.url}/v1/trajectories"
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert pool.num_complete() == 0
    for gid, key in enumerate((s.api_key, proxy.registry.service.api_key)):  # a session's key, or the service's
        r = httpx.post(url, json={**body, "group_id": gid}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    assert pool.num_complete() == 2


def test_the_debug_summary_counts_forks_by_cause(tmp_path):
    from test_trace import make_record

    from axrl.trace import TraceReader, write_step
    from axrl_debug.analysis.sessions import sessions_by_step

    write_step(tmp_path / "trace", make_record(step=0))  # every other sample a fork, cause "history edited"
    (row,) = sessions_by_step(TraceReader(tmp_path))
    assert row["forks"] > 0 and row["fork_causes"] == {HISTORY_EDITED: row["forks"]}


def test_a_template_that_cannot_render_appended_messages_alone_forks_with_its_cause(tmp_path):
    """A template that renders an earlier reply only as "[earlier]" once anything follows it: the
    appended messages cannot be told apart from the re-rendered reply, so the call is a new root
    rendered whole — recorded, not silent."""
    template = REASONING_TEMPLATE.replace("{{- content }}", "{{- content if loop.last else '[earlier]' }}")
    tok = with_template(tmp_path, template)
    engine = ScriptedEngine(lambda prompt: tok.encode("hello") + [tok.eos_token_id])
    with ProxyServer(tok, model_name="policy") as proxy:
        s = proxy.open_session(engine_submit(engine), SessionPolicy(SamplingParams(
            max_new_tokens=8, stop_token_ids=tok.stop_token_ids), max_tokens=8), max_context_len=512)
        client = openai.OpenAI(base_url=proxy.base_url(s), api_key=s.api_key, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        client.chat.completions.create(model="policy", messages=messages + [
            reply.model_dump(), {"role": "user", "content": "again"}])
    assert [(t.parent, t.fork_cause) for t in s.turns.values()] == [(None, ""), (None, TEMPLATE_UNSTABLE)]
    assert s.turns[2].prompt_ids == tok.apply_chat_template(
        messages + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
        add_generation_prompt=True)
    assert [p.fork_cause for p in s.trajectories(sample_id=0, group_id=0, prompt_id="q")] == ["", TEMPLATE_UNSTABLE]
