"""Agents: the env protocol, the white-box agent loop (token stream, masks, routing, finish
reasons), the built-in tasks and the prompt loader.

The loop runs against the real embedded engine on a random micro-MoE model (multi-turn, routing,
300+ turns, context limit) and against a scripted engine that returns given token ids, where a
test needs exact tokens (stream == chat template, glue, per-turn requests).
"""

from __future__ import annotations

import asyncio
import json
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from axrl.agents.env import Env, Prompt, StepOutcome, assistant_text, replay_conversation
from axrl.agents.tasks import TASKS, get_task
from axrl.agents.tasks.calculator import CalculatorError, evaluate
from axrl.agents.tasks.common import format_number, parse_answer
from axrl.core.trajectory import Trajectory
from axrl.data import PromptDataError, PromptLoader, read_prompt_file
from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.model import build_model, preset_config
from axrl.rollout.agent_loop import run_episode, turn_seed
from axrl.tokenizer import Tokenizer
from agent_util import ScriptedEngine

torch.set_num_threads(1)

MODEL_SEED = 0


@pytest.fixture(scope="module")
def engine(tok: Tokenizer):
    eng = EmbeddedEngine(build_model(preset_config("micro-moe"), seed=MODEL_SEED), max_batch_size=8,
                         max_seq_len=8192, eos_token_id=tok.eos_token_id, weight_version=3)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference_model():
    """An identical copy of the engine's weights for full-forward references."""
    return build_model(preset_config("micro-moe"), seed=MODEL_SEED).eval()


def run(coro):
    return asyncio.run(coro)


#: the agent-loop tests' scripted engine: weights version 7, a routing row per token when asked
SCRIPTED = {"version": 7, "routing": True}


def episode(engine, tok, env, prompt, *, max_new_tokens=8, seed=1, max_turns=8, max_context_len=2048,
            return_routing=False, sample_id=0) -> Trajectory:
    return run(run_episode(engine, tok, env, prompt, sample_id=sample_id, group_id=0,
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=seed),
                           max_turns=max_turns, max_context_len=max_context_len,
                           return_routing=return_routing))


def assert_well_formed(traj: Trajectory) -> None:
    """Invariants every trajectory satisfies, whatever the engine generated."""
    traj.check()
    mask = traj.loss_mask.astype(np.int64)
    versions = np.array(traj.policy_version)
    logprobs = np.array(traj.rollout_logprob)
    assert set(np.unique(mask)) <= {0, 1}
    assert (np.isnan(logprobs) == (mask == 0)).all(), "NaN exactly where not generated"
    assert ((versions == -1) == (mask == 0)).all(), "version -1 exactly where not generated"
    assert (np.diff(traj.turn) >= 0).all() and traj.turn[0] == 0
    assert all(m == 0 for m in traj.loss_mask[:traj.prompt_len])
    assert all(t == 0 for t in traj.turn[:traj.prompt_len])
    if traj.num_tokens > traj.prompt_len and traj.finish_reason not in ("context", "failed"):
        assert traj.loss_mask[-1] == 1, "a finished stream ends with the last generated token"
    # Generated tokens of turn i, then the env's masked answer to turn i.
    for i in range(1, traj.num_turns + 1):
        idx = [j for j, t in enumerate(traj.turn) if t == i]
        seg = mask[idx]
        assert seg[0] == 1 and (np.diff(seg) <= 0).all(), f"turn {i}: generated, then masked"


def masked_runs(traj: Trajectory) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(traj.token_ids, traj.loss_mask):
        if m == 0:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


# ============================================================================ agent loop, exact tokens


def test_stream_equals_chat_template_of_final_conversation(tok):
    task = get_task("calculator")
    prompt = task.prompt(0, 0)
    env = task.make_env()
    demo = task.demonstration(prompt)
    call_text, final_text = assistant_text(tok, demo[-3]), demo[-1]["content"]
    eos = tok.eos_token_id
    eng = ScriptedEngine([tok.encode(call_text) + [eos], tok.encode(final_text) + [eos]], eos=eos, **SCRIPTED)
    assert isinstance(eng, InferenceEngine)
    traj = episode(eng, tok, env, prompt, max_new_tokens=64)
    assert_well_formed(traj)
    assert (traj.finish_reason, traj.status, traj.reward, traj.num_turns) == ("stop", "ok", 1.0, 2)

    # The stream is the template's rendering of the final conversation, minus the glue after
    # the last assistant turn (the newline after <|im_end|>) that nothing reads.
    full = tok.apply_chat_template(demo, tools=env.tools)
    assert traj.token_ids.tolist() == full[:-1] and full[-1:] == tok.encode("\n")
    assert traj.info["messages"][-1] == {"role": "assistant", "content": final_text}

    opening = tok.apply_chat_template(env.reset(prompt), tools=env.tools, add_generation_prompt=True)
    assert traj.prompt_len == len(opening) and traj.token_ids[:len(opening)].tolist() == opening
    gen1 = tok.encode(call_text) + [eos]
    glue = tok.encode("\n") + tok.encode_message(demo[-2]) + tok.generation_prompt_ids()
    gen2 = tok.encode(final_text) + [eos]
    P = len(opening)
    assert traj.loss_mask.tolist() == [0] * P + [1] * len(gen1) + [0] * len(glue) + [1] * len(gen2)
    assert traj.turn.tolist() == [0] * P + [1] * (len(gen1) + len(glue)) + [2] * len(gen2)
    assert traj.policy_version.tolist() == [-1] * P + [7] * len(gen1) + [-1] * len(glue) + [7] * len(gen2)
    gen = np.array(traj.loss_mask) == 1
    assert np.all(np.array(traj.rollout_logprob)[gen] == -0.5)

    # Every request carries the whole stream so far and a per-turn seed.
    r1, r2 = eng.requests
    assert r1.input_ids == opening and r2.input_ids == opening + gen1 + glue
    assert r1.return_logprob and r2.return_logprob
    assert r1.sampling_params.seed == turn_seed(1, 1) != r2.sampling_params.seed == turn_seed(1, 2)
    assert r1.sampling_params.max_new_tokens == r2.sampling_params.max_new_tokens == 64


def test_routing_rows_align_one_per_token(tok):
    eos = tok.eos_token_id
    task = get_task("echo", turns=3)
    prompt = task.prompt(0, 1)
    words = prompt.fields["words"]
    eng = ScriptedEngine([tok.encode(w) + [eos] for w in words], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, return_routing=True)
    assert_well_formed(traj)
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    T = traj.num_tokens
    assert traj.routed_experts.shape == (T, ScriptedEngine.L, ScriptedEngine.K)
    assert traj.routed_experts.dtype == np.int32
    # Row p holds position p's routing (p + 1 in the script); the last token's row is zeros.
    assert (traj.routed_experts[:-1, 0, 0] == np.arange(1, T)).all()
    assert (traj.routed_experts[-1] == 0).all()
    # Each request asks only for rows past those already held: previous input + output - 1.
    starts = [r.routed_experts_start_len for r in eng.requests]
    ends = [len(r.input_ids) for r in eng.requests]
    outputs = [len(tok.encode(w)) + 1 for w in words]
    assert starts == [0] + [n_in + n_out - 1 for n_in, n_out in zip(ends, outputs)][:-1]
    assert all(s < e for s, e in zip(starts, ends))


def test_per_token_versions_within_a_turn(tok):
    eos = tok.eos_token_id
    task = get_task("arithmetic")
    prompt = task.prompt(0, 0)
    ids = tok.encode(f"The answer is {prompt.fields['answer']}.") + [eos]
    versions = [4] * 3 + [5] * (len(ids) - 3)  # weights updated mid-request (partial rollout)
    eng = ScriptedEngine([{"ids": ids, "versions": versions}], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_new_tokens=64)
    assert_well_formed(traj)
    assert traj.policy_version[traj.prompt_len:].tolist() == versions and traj.reward == 1.0


def test_truncated_turn_is_closed_with_masked_eos_and_length_finish(tok):
    eos = tok.eos_token_id
    task = get_task("echo", turns=2)
    prompt = task.prompt(0, 0)
    long_reply = tok.encode(" ".join(["word"] * 20))
    eng = ScriptedEngine([long_reply, long_reply], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_new_tokens=5)
    assert_well_formed(traj)
    # Turn 1 hit the per-turn limit; the env went on, so the loop closed the turn itself
    # (<|im_end|> masked: the model did not generate it). Turn 2 was cut too and the env ended.
    assert traj.finish_reason == "length" and traj.num_turns == 2
    runs = masked_runs(traj)
    assert runs[1][:2] == tok.encode("<|im_end|>\n")
    assert traj.num_generated == 10 and traj.token_ids[-1] != eos


def test_abort_keeps_partial_turn(tok):
    eos = tok.eos_token_id
    task = get_task("echo", turns=3)
    prompt = task.prompt(0, 0)
    eng = ScriptedEngine([tok.encode(prompt.fields["words"][0]) + [eos], {"ids": [17, 18], "type": "abort"}],
                         eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, return_routing=True)
    assert_well_formed(traj)
    assert traj.finish_reason == "abort" and traj.num_turns == 2 and traj.token_ids[-2:].tolist() == [17, 18]
    assert traj.routed_experts.shape[0] == traj.num_tokens


def test_context_limit_exact(tok):
    eos = tok.eos_token_id
    task = get_task("echo", turns=50)
    prompt = task.prompt(0, 0)
    P = len(tok.apply_chat_template(task.make_env().reset(prompt), add_generation_prompt=True))
    # Generation is capped by the room left: the first turn fills the context exactly.
    eng = ScriptedEngine([[100] * 50], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_new_tokens=50, max_context_len=P + 4,
                   return_routing=True)
    assert eng.requests[0].sampling_params.max_new_tokens == 4
    assert traj.finish_reason == "context" and traj.num_tokens == P + 4
    assert traj.routed_experts.shape[0] == P + 4
    # A complete turn whose follow-up segment does not fit: stop before any partial glue.
    reply = tok.encode(prompt.fields["words"][0]) + [eos]
    eng = ScriptedEngine([reply], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_new_tokens=50, max_context_len=P + len(reply) + 3)
    assert traj.finish_reason == "context" and traj.num_tokens == P + len(reply)
    assert traj.loss_mask[-1] == 1
    # A prompt that alone does not fit is cut at the limit; nothing is generated.
    eng = ScriptedEngine([], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_context_len=P - 2)
    assert traj.finish_reason == "context" and traj.num_tokens == P - 2 and traj.num_generated == 0
    assert traj.info["prompt_truncated"] and not eng.requests


class FlakyEnv:
    """Rewards turn 1, then raises on `fail_at` (or in reset when fail_at == 0)."""

    def __init__(self, fail_at: int, bad_observation: bool = False) -> None:
        self.tools: list[dict] = []
        self.fail_at, self.bad_observation, self.turn = fail_at, bad_observation, 0

    def reset(self, prompt: Prompt) -> list[dict]:
        if self.fail_at == 0:
            raise ConnectionError("sandbox unavailable")
        self.turn = 0
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        self.turn += 1
        if self.turn == self.fail_at:
            raise ZeroDivisionError("tool crashed")
        if self.bad_observation:
            return StepOutcome([{"role": "user"}], 0.5, False)  # no content: the template rejects it
        return StepOutcome([{"role": "user", "content": "go on"}], 0.5, False)


def test_env_errors_fail_the_episode_without_raising(engine, tok):
    prompt = Prompt("p0", text="hello")
    assert isinstance(FlakyEnv(1), Env)
    traj = episode(engine, tok, FlakyEnv(fail_at=2), prompt, max_new_tokens=3, return_routing=True)
    assert_well_formed(traj)
    assert (traj.status, traj.finish_reason, traj.reward, traj.num_turns) == ("failed", "failed", 0.0, 2)
    assert "ZeroDivisionError: tool crashed" in traj.error and "Traceback" in traj.error
    assert traj.routed_experts.shape[0] == traj.num_tokens

    traj = episode(engine, tok, FlakyEnv(fail_at=0), prompt)
    assert (traj.status, traj.finish_reason, traj.num_tokens) == ("failed", "failed", 0)
    assert "ConnectionError: sandbox unavailable" in traj.error

    traj = episode(engine, tok, FlakyEnv(fail_at=-1, bad_observation=True), prompt, max_new_tokens=3)
    assert traj.status == "failed" and "content" in traj.error and traj.num_turns == 1


def test_max_turns(engine, tok):
    task = get_task("echo", turns=10)
    traj = episode(engine, tok, task.make_env(), task.prompt(0, 0), max_new_tokens=3, max_turns=3)
    assert_well_formed(traj)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3 and max(traj.turn) == 3
    assert traj.loss_mask[-1] == 1 and traj.reward == 0.0


def test_bad_limits_raise(engine, tok):
    with pytest.raises(ValueError, match="max_turns"):
        episode(engine, tok, get_task("echo").make_env(), get_task("echo").prompt(0, 0), max_turns=0)


# ============================================================================ agent loop, real engine


def test_multi_turn_on_embedded_engine(engine, tok):
    task = get_task("echo", turns=4)
    prompts = [task.prompt(5, i) for i in range(6)]

    async def many():
        return await asyncio.gather(*(
            run_episode(engine, tok, task.make_env(), p, sample_id=i, group_id=i // 2,
                        sampling=SamplingParams(max_new_tokens=6, seed=100 + i, temperature=1.0),
                        max_turns=10, max_context_len=1024)
            for i, p in enumerate(prompts)))

    trajs = run(many())
    close = tok.encode("<|im_end|>\n")
    for i, (traj, prompt) in enumerate(zip(trajs, prompts)):
        assert_well_formed(traj)
        assert traj.sample_id == i and traj.group_id == i // 2 and traj.prompt_id == prompt.prompt_id
        assert traj.finish_reason in ("stop", "length") and traj.num_turns == 4
        assert set(traj.policy_version) == {-1, 3}
        gen = np.array(traj.loss_mask) == 1
        assert np.all(np.array(traj.rollout_logprob)[gen] <= 0)
        # Masked stretches are exactly the template's rendering of what the env said.
        runs = masked_runs(traj)
        assert runs[0] == tok.apply_chat_template(task.make_env().reset(prompt), add_generation_prompt=True)
        words = prompt.fields["words"]
        for k, seg in enumerate(runs[1:], start=1):
            body = tok.encode_message({"role": "user", "content": words[k]}) + tok.generation_prompt_ids()
            assert seg[-len(body):] == body
            assert seg[:-len(body)] in (close, close[1:])  # the loop adds <|im_end|> only to cut turns
        # info["messages"] is the conversation the env saw.
        assert [m["role"] for m in traj.info["messages"]] == ["user"] + ["assistant", "user"] * 3 + ["assistant"]
    # Same seeds -> same episode (per-request generators seeded from the sample seed and turn).
    again = episode(engine, tok, task.make_env(), prompts[0], max_new_tokens=6, seed=100, max_turns=10,
                    max_context_len=1024)
    assert again.token_ids.tolist() == trajs[0].token_ids.tolist()


def test_routing_on_embedded_engine_matches_full_forward(engine, tok, reference_model):
    task = get_task("calculator")
    prompt = task.prompt(0, 3)
    traj = episode(engine, tok, task.make_env(), prompt, max_new_tokens=12, return_routing=True)
    # A random model rarely calls the tool; echo gives several turns for certain.
    echo = get_task("echo", turns=5)
    traj2 = episode(engine, tok, echo.make_env(), echo.prompt(0, 2), max_new_tokens=4, return_routing=True)
    cfg = reference_model.config
    for t in (traj, traj2):
        assert_well_formed(t)
        T = t.num_tokens
        assert t.routed_experts.shape == (T, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert (t.routed_experts[-1] == 0).all()
        with torch.no_grad():
            ref_prompt = reference_model(torch.tensor([t.token_ids[:t.prompt_len]]), return_routing=True,
                                         compute_logits=False).routed_experts[0].numpy()
            ref_full = reference_model(torch.tensor([t.token_ids]), return_routing=True,
                                       compute_logits=False).routed_experts[0].numpy()
        # Prompt rows come from the engine's prefill, which is the model's own forward.
        np.testing.assert_array_equal(t.routed_experts[:t.prompt_len], ref_prompt)
        # Later rows come from KV-cache decode / re-prefill: equal up to rare float near-ties.
        agree = np.mean(np.sort(t.routed_experts[:-1], -1) == np.sort(ref_full[:-1], -1))
        assert agree > 0.98, agree


def test_thousand_turn_episode_scripted(tok):
    """The loop itself stays cheap and exact over very long episodes (no engine cost)."""
    turns = 1000
    task = get_task("echo", turns=turns)
    prompt = task.prompt(0, 0)
    eos = tok.eos_token_id
    eng = ScriptedEngine([tok.encode(w) + [eos] for w in prompt.fields["words"]], eos=eos, **SCRIPTED)
    traj = episode(eng, tok, task.make_env(), prompt, max_turns=turns, max_context_len=100_000,
                   return_routing=True)
    assert_well_formed(traj)
    assert (traj.finish_reason, traj.num_turns, traj.reward) == ("stop", turns, 1.0)
    assert traj.token_ids.tolist() == tok.apply_chat_template(task.demonstration(prompt))[:-1]
    assert (traj.routed_experts[:-1, 0, 0] == np.arange(1, traj.num_tokens)).all()


# ~1.5 s on one CPU thread with the engine's prefix cache (each turn prefills only its new tokens,
# linear in turns); ~45 s without it, re-prefilling the whole stream every turn (bench/engine_prefix_cache.py).
def test_three_hundred_turn_episode(engine, tok):
    turns = 300
    task = get_task("echo", turns=turns)
    prompt = task.prompt(0, 0)
    traj = episode(engine, tok, task.make_env(), prompt, max_new_tokens=1, max_turns=turns + 10,
                   max_context_len=8192, return_routing=True)
    assert_well_formed(traj)
    assert traj.finish_reason == "length" and traj.status == "ok" and traj.num_turns == turns
    assert traj.num_generated == turns and max(traj.turn) == turns
    assert traj.routed_experts.shape[0] == traj.num_tokens <= 8192
    assert len(traj.info["messages"]) == 2 * turns


# ============================================================================ tasks


def test_safe_calculator():
    assert evaluate("37 + 58") == 95 and evaluate("(1 + 2) * -3") == -9 and evaluate("2 ** 10") == 1024
    assert evaluate("7 / 2") == Fraction(7, 2) and evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("12 × 3") == 36 and evaluate("17 // 5 + 17 % 5") == 5
    assert format_number(evaluate("7/2")) == "3.5" and format_number(evaluate("1/3")) == "1/3"
    assert format_number(Fraction(-7, 4)) == "-1.75" and format_number(-3) == "-3"
    for bad in ["__import__('os')", "__import__('os').system('echo hi')", "open('/etc/passwd')",
                "x + 1", "(1).__class__", "[1, 2]", "True + 1", "'a' * 3", "lambda: 1", "1 if 1 else 2"]:
        with pytest.raises(CalculatorError, match="unsupported"):
            evaluate(bad)
    for bad, why in [("1 / 0", "division by zero"), ("9 ** 9 ** 9", "exponent"), ("", "empty"),
                     ("1 +", "invalid"), ("2 ** 0.5", "integer exponents"), ("1" * 300, "longer"),
                     ("99 ** 60 * 99 ** 60", "too large")]:
        with pytest.raises(CalculatorError, match=why):
            evaluate(bad)


def call(expression: Any = None, name: str = "calculator", raw: str | None = None) -> str:
    if raw is None:
        args = {} if expression is None else {"expression": expression}
        raw = json.dumps({"name": name, "arguments": args})
    return f"<tool_call>\n{raw}\n</tool_call>"


def test_calculator_env_rewards_and_errors():
    task = get_task("calculator")
    prompt = Prompt("q", text="What is 37 + 58?", fields={"answer": 95})
    env = task.make_env()

    def play(*actions: str) -> list[StepOutcome]:
        env.reset(prompt)
        return [env.step(a) for a in actions]

    first, last = play(call("37 + 58"), "The answer is 95.")
    assert first.observation == [{"role": "tool", "tool_call_id": "call00001", "content": "95"}] and not first.done and first.reward == 0
    assert last.done and last.reward == 1.0 and last.observation == [] and last.info["correct"]
    assert play("The answer is 95.")[0].reward == pytest.approx(0.1)  # right, but without the tool
    assert play(call("37 + 58"), "The answer is 96.")[-1].reward == 0.0
    assert play(call("37 + 58"), "I don't know.")[-1].reward == 0.0
    # Malformed calls get error tool messages, not exceptions, and do not count as tool use.
    for action, why in [(call(raw='{"name": "calculator", "arguments": {'), "invalid JSON"),
                        (call("1 + 1", name="search"), "unknown tool"),
                        (call(None), "expression"), (call(5), "expression"),
                        (call("__import__('os')"), "unsupported"), (call("1 / 0"), "division by zero"),
                        ("<tool_call>\n{\"name\": \"calculator\"", "unterminated")]:
        out, final = play(action, "The answer is 95.")
        assert not out.done and out.observation[0]["role"] == "tool"
        assert out.observation[0]["content"].startswith("Error:") and why in out.observation[0]["content"]
        assert final.reward == pytest.approx(0.1)
    # Two calls in one turn: two tool messages, in order.
    env.reset(prompt)
    out = env.step(call("37 + 58") + "\n" + call("95 - 1"))
    assert [m["content"] for m in out.observation] == ["95", "94"]
    # At most three calls; a fourth ends the episode unanswered.
    outs = play(call("1 + 1"), call("2 + 2"), call("3 + 3"), call("4 + 4"))
    assert [o.done for o in outs] == [False, False, False, True] and outs[-1].reward == 0.0
    assert outs[-1].info["reason"] == "too_many_tool_calls"
    outs = play(call("1 + 1"), call("2 + 2"), call("37 + 58"), "The answer is 95.")
    assert outs[-1].reward == 1.0


def test_answer_parsing_and_arithmetic_env():
    assert parse_answer("The answer is 95.") == 95
    assert parse_answer("answer is -12, not 3") == -12
    assert parse_answer("2 + 2 = 4") == 4 and parse_answer("1,234 apples") == 1234
    assert parse_answer("The answer is 2.5") == Fraction(5, 2) and parse_answer("no idea") is None
    task = get_task("arithmetic")
    prompt = task.prompt(0, 0)
    a = prompt.fields["answer"]
    assert prompt.text == f"Compute {prompt.fields['expression']}." and a == evaluate(prompt.fields["expression"])
    env = task.make_env()
    for reply, reward in [(f"The answer is {a}.", 1.0), (f"{a}", 1.0), (f"The answer is {a + 1}.", 0.0),
                          ("I cannot say.", 0.0), (f"The answer is {a}0", 0.0)]:
        env.reset(prompt)
        out = env.step(reply)
        assert out.done and out.reward == reward, reply
    env.reset(Prompt("s", text="Compute 2 * 3.", fields={"answer": "6"}))  # file prompts: strings
    assert env.step("The answer is 6").reward == 1.0
    with pytest.raises(ValueError, match="answer"):
        env.reset(Prompt("s", text="Compute 2 * 3."))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_demonstrations_replay_to_full_reward(name, tok):
    task = get_task(name)
    for index in range(10):
        prompt = task.prompt(3, index)
        demo = task.demonstration(prompt)
        env = task.make_env()
        text = tok.apply_chat_template(demo, tools=env.tools or None, tokenize=False)
        assert text.count("<|im_start|>assistant\n") == sum(m["role"] == "assistant" for m in demo)
        assert demo[-1]["role"] == "assistant"
        assert replay_conversation(env, prompt, demo, tok) == pytest.approx(1.0)


def test_demonstration_through_the_agent_loop_gives_the_template_stream(tok):
    """The agent loop fed the demonstration's tokens reproduces the supervised warm-up data."""
    task = get_task("echo", turns=4)
    prompt = task.prompt(1, 1)
    demo = task.demonstration(prompt)
    eos = tok.eos_token_id
    replies = [tok.encode(assistant_text(tok, m)) + [eos] for m in demo if m["role"] == "assistant"]
    traj = episode(ScriptedEngine(replies, eos=eos, **SCRIPTED), tok, task.make_env(), prompt)
    assert traj.reward == 1.0 and traj.token_ids.tolist() == tok.apply_chat_template(demo)[:-1]


def test_task_prompts_are_deterministic_and_configurable():
    task = get_task("calculator", min_operand=100, max_operand=999, ops=("*",))
    a, b = task.prompt(7, 3), get_task("calculator", min_operand=100, max_operand=999, ops=("*",)).prompt(7, 3)
    assert a == b and a.prompt_id == "calculator-7-3"
    x, op, y = a.fields["expression"].split()
    assert op == "*" and 100 <= int(x) <= 999 and 100 <= int(y) <= 999
    stream = task.prompts(7, start=3)
    assert next(stream) == a and next(stream) == task.prompt(7, 4)
    assert len({task.prompt(s, 0).text for s in range(20)}) > 10
    default = get_task("calculator").prompt(0, 0).fields["expression"].split()
    assert 10 <= int(default[0]) <= 99


def test_registry_errors():
    with pytest.raises(ValueError, match=r"unknown task 'nope'; known tasks: \['arithmetic', 'calculator', 'echo', 'reasoning_gym'\]"):
        get_task("nope")
    with pytest.raises(ValueError, match="unknown option.*max_operandd.*valid options"):
        get_task("calculator", max_operandd=5)
    with pytest.raises(ValueError, match="min_operand"):
        get_task("arithmetic", min_operand=9, max_operand=1)
    with pytest.raises(ValueError, match="ops"):
        get_task("arithmetic", ops=("/",))


# ============================================================================ prompt loader


def write_jsonl(path, rows: list[Any]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


ROWS = [
    {"prompt": "What is 1 + 1?", "answer": 2},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
     "prompt_id": "q-1", "answer": 5},
    {"prompt": "What is 4 * 4?", "answer": 16, "difficulty": "easy"},
    {"prompt": "What is 9 - 1?", "prompt_id": 42, "answer": 8},
    {"prompt": "What is 6 + 6?", "answer": 12},
]


def test_loader_reads_jsonl_and_parquet(tmp_path):
    import pyarrow as pa  # a dependency of axrl
    import pyarrow.parquet as pq
    write_jsonl(tmp_path / "p.jsonl", ROWS)
    table = pa.Table.from_pylist([{**r, "prompt": r["prompt"] if isinstance(r["prompt"], list)
                                   else [{"role": "user", "content": r["prompt"]}],
                                   "prompt_id": str(r.get("prompt_id", f"p-{i}"))}
                                  for i, r in enumerate(ROWS)])
    pq.write_table(table, tmp_path / "p.parquet")
    from_jsonl = read_prompt_file(tmp_path / "p.jsonl")
    from_parquet = read_prompt_file(tmp_path / "p.parquet")
    assert [p.prompt_id for p in from_jsonl] == ["p-0", "q-1", "p-2", "42", "p-4"]
    assert from_jsonl[0].text == "What is 1 + 1?" and from_jsonl[0].fields == {"answer": 2}
    assert from_jsonl[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert from_jsonl[2].fields == {"answer": 16, "difficulty": "easy"}
    assert [p.prompt_id for p in from_parquet] == ["p-0", "q-1", "p-2", "42", "p-4"]
    assert [p.as_messages() for p in from_parquet] == [p.as_messages() for p in from_jsonl]
    assert from_parquet[0].fields == {"answer": 2}  # absent columns (difficulty) are dropped
    # File prompts drive the built-in envs.
    env = get_task("arithmetic").make_env()
    env.reset(from_parquet[1])
    assert env.step("The answer is 5.").reward == 1.0


def test_loader_bad_rows_name_file_and_line(tmp_path):
    cases = [
        (['{"prompt": "ok", "answer": 1}', '{"prompt": "broken"'], r"bad\.jsonl line 2: invalid JSON"),
        ([{"prompt": "ok"}, {"answer": 3}], r"line 2: missing required field 'prompt'"),
        ([{"prompt": ""}], "line 1: 'prompt' is an empty string"),
        ([{"prompt": 5}], "line 1: 'prompt' must be"),
        ([{"prompt": [{"role": "robot", "content": "hi"}]}], "line 1: prompt message 0 has role 'robot'"),
        ([{"prompt": [{"role": "user", "content": 3}]}], "line 1: prompt message 0 needs a string 'content'"),
        ([[1, 2]], "line 1: expected an object"),
        ([{"prompt": "a", "prompt_id": "x"}, "", {"prompt": "b", "prompt_id": "x"}],
         "line 3: prompt_id 'x' already used at line 1"),
        ([], "no prompts"),
    ]
    for rows, message in cases:
        write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(PromptDataError, match=message):
            PromptLoader.from_file(tmp_path / "bad.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": None}]), tmp_path / "bad.parquet")
    with pytest.raises(PromptDataError, match=r"bad\.parquet row 1: missing required field 'prompt'"):
        read_prompt_file(tmp_path / "bad.parquet")
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(PromptDataError, match="unknown prompt file type '.csv'"):
        read_prompt_file(tmp_path / "p.csv")
    with pytest.raises(PromptDataError, match="no such file"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_loader_epochs_determinism_and_resume(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", ROWS)

    def ids(batch):
        return [p.prompt_id for p in batch]

    a, b = PromptLoader.from_file(tmp_path / "p.jsonl", seed=3), PromptLoader.from_file(tmp_path / "p.jsonl", seed=3)
    first = [ids(a.next_batch(2)) for _ in range(10)]
    assert first == [ids(b.next_batch(2)) for _ in range(10)]
    flat = sum(first, [])
    epochs = [flat[i:i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == sorted(ids(read_prompt_file(tmp_path / "p.jsonl"))) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "each epoch is reshuffled"
    assert a.epoch == 3
    assert ids(PromptLoader.from_file(tmp_path / "p.jsonl", shuffle=False).next_batch(6)) == \
        ["p-0", "q-1", "p-2", "42", "p-4", "p-0"]

    # Resume: a fresh loader restored from state continues exactly where the first one was.
    c = PromptLoader.from_file(tmp_path / "p.jsonl", seed=3)
    c.next_batch(7)
    state = json.loads(json.dumps(c.state()))
    d = PromptLoader.from_file(tmp_path / "p.jsonl", seed=3)
    d.load_state(state)
    assert ids(d.next_batch(9)) == ids(c.next_batch(9)) == flat[7:16]
    with pytest.raises(ValueError, match="seed"):
        PromptLoader.from_file(tmp_path / "p.jsonl", seed=4).load_state(state)
    write_jsonl(tmp_path / "p.jsonl", ROWS[:-1] + [{"prompt": "changed", "answer": 1}])
    with pytest.raises(ValueError, match="digest"):
        PromptLoader.from_file(tmp_path / "p.jsonl", seed=3).load_state(state)

    # Task streams: deterministic from the seed, resumable by index.
    t1 = PromptLoader.from_source("task:arithmetic", seed=5, max_operand=5)
    t1.next_batch(4)
    t2 = PromptLoader.from_task("arithmetic", seed=5, max_operand=5)
    t2.load_state(t1.state())
    assert t1.next_batch(3) == t2.next_batch(3) == [get_task("arithmetic", max_operand=5).prompt(5, i)
                                                     for i in range(4, 7)]
    with pytest.raises(ValueError, match="source"):
        PromptLoader.from_task("echo", seed=5).load_state(t1.state())
    with pytest.raises(ValueError, match="digest"):  # same task, other options
        PromptLoader.from_task("arithmetic", seed=5, max_operand=50).load_state(t1.state())
    with pytest.raises(TypeError):
        len(t1)
    # Returned prompts are copies: mutating one does not change later epochs.
    e = PromptLoader.from_file(tmp_path / "p.jsonl", shuffle=False)
    e.next_batch(1)[0].fields["answer"] = -1
    e.next_batch(4)
    assert e.next_batch(1)[0].fields["answer"] == 2
