"""Template conformance: model directories in the chat conventions of Qwen3, Qwen3-Coder, ChatML /
Qwen2.5, Hermes-3, Llama 3.1 / 3.2, Mistral, DeepSeek-V3 / V3.1 / R1 distills, Kimi-K2, gpt-oss,
GLM-4.5, Gemma 3 and Gemma 4 (tests/templates/, built by
tests/template_models.py the way users make them), with transformers' own
``AutoTokenizer.from_pretrained(dir).apply_chat_template`` as the oracle:

(a) AxRL renders Hugging Face-form messages (tools, tool calls, tool results) exactly as
    transformers does, text and ids;
(b) the white-box agent loop trains on exactly the generated ids, renders everything between
    replies as the template does, and counts where the template re-renders history as drift;
(c) ``axrl train`` with ``model.path`` on the directory runs two steps and its trace decodes with
    that directory's tokenizer;

plus the refusal of templates AxRL cannot follow and ``axrl model check-template``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from axrl.agents.env import Prompt, StepOutcome
from axrl.agents.tasks.calculator import CALCULATOR_TOOL, SYSTEM_PROMPT
from axrl.tokenizer import parse_tool_calls
from axrl.inference.protocol import SamplingParams
from axrl.rollout.agent_loop import run_episode
from axrl.tokenizer import load_tokenizer
from axrl.tokenizer.tool_calls import hf_tool_call, hf_tool_result
from axrl.trace import StepFile
from agent_util import ScriptedEngine
from hf_checkpoint import MODEL_VOCAB, write_checkpoint
from template_models import CONVENTIONS, write_convention_dir
from train_util import axrl, train

import transformers  # noqa: E402  (the test extra installs it: a broken import fails)
torch.set_num_threads(1)

NAMES = sorted(CONVENTIONS)
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate <x> & 'y'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ARGS = [{"expression": "37 + 58"}, {"expression": "2 * 3"}]
RESULTS = ["95", "6"]
# What each convention's tokenizer should read off its template:
# (turn-end token, reply opening, tool-call start (None: tool-free), re-renders history, tool parser,
#  calls per turn, arguments form)
EXPECTED = {
    "qwen3": ("<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", True, "hermes", 2, "string"),
    "chatml": ("<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", False, "hermes", 2, "string"),
    "hermes3": ("<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", False, "hermes", 2, "string"),
    "kimi_k2": ("<|im_end|>", "<|im_assistant|>assistant<|im_middle|>", "<|tool_calls_section_begin|>", False,
                "kimi_k2", 2, "string"),
    "qwen3_coder": ("<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", False, "qwen3_coder", 2, "mapping"),
    "llama3": ("<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n", "", False, "llama3_json", 1,
               "mapping"),
    "mistral": ("</s>", "", "[TOOL_CALLS]", True, "mistral", 2, "string"),
    # V3-0324 writes <｜Assistant｜> after every user turn, so the generation prompt adds nothing
    "deepseek_v3": ("<｜end▁of▁sentence｜>", "", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", False,
                    "deepseek_v3", 2, "string"),
    "deepseek_v31": ("<｜end▁of▁sentence｜>", "<｜Assistant｜></think>", "<｜tool▁call▁begin｜>", True, "deepseek_v31",
                     2, "string"),
    "r1_distill": ("<｜end▁of▁sentence｜>", "<｜Assistant｜><think>\n", None, True, None, 0, "mapping"),
    "gemma": ("<end_of_turn>", "<start_of_turn>model\n", None, False, None, 0, "mapping"),
    # harmony writes one call per turn; a final answer ends with <|return|> but with <|end|> in history: drift
    "gpt_oss": ("<|return|>", "<|start|>assistant", "to=functions.", True, "openai", 1, "mapping"),
    # the generation prompt closes an empty thought channel that history never shows: drift
    "gemma4": ("<turn|>", "<|turn>model\n<|channel>thought\n<channel|>", "<|tool_call>", True, "gemma4", 2, "mapping"),
    # no token closes a reply: the next turn's <|user|> does (or <|observation|> before tool results)
    "glm45": ("<|user|>", "<|assistant|>", "<tool_call>", True, "glm45", 2, "mapping"),
}
# A call's turn closes with another stop token than the turn end: gpt-oss's <|call|>, and GLM-4.5's
# next-turn <|observation|> (its template writes nothing after a reply; the model generates that).
CALL_CLOSE = {"gpt_oss": "<|call|>", "glm45": "<|observation|>"}
TOOL_FREE = sorted(n for n in NAMES if EXPECTED[n][2] is None)
WITH_TOOLS = sorted(n for n in NAMES if EXPECTED[n][2] is not None)


def calls(name: str) -> dict:
    """An assistant turn with as many parallel calls as the family's template allows, arguments
    in the form its template reads (the wire's JSON string, or a mapping)."""
    n, form = EXPECTED[name][5], EXPECTED[name][6]
    made = [hf_tool_call("calculator", json.dumps(a) if form == "string" else a, k + 1) for k, a in enumerate(ARGS[:n])]
    if name == "kimi_k2":  # Kimi's ids carry the name: functions.NAME:INDEX
        made = [{**c, "id": f"functions.calculator:{k}"} for k, c in enumerate(made)]
    return {"role": "assistant", "content": "", "tool_calls": made}


def conversation(name: str) -> list[dict]:
    """An agent episode in the family's shapes: system, question, calls and results (where the
    template has tools), a reasoning answer, a new question."""
    n = EXPECTED[name][5]
    middle = [calls(name)] + [hf_tool_result(RESULTS[k], k + 1) for k in range(n)] if n else []
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 37 + 58? Ünïcödé ✓"},
            *middle, {"role": "assistant", "content": "<think>\nadd\n</think>\n\nThe answer is 95."},
            {"role": "user", "content": "And 1 + 1?"}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conventions")
    return {name: write_convention_dir(root / name, CONVENTIONS[name]) for name in NAMES}


@pytest.fixture(scope="module")
def hf(dirs):
    return {name: transformers.AutoTokenizer.from_pretrained(str(d)) for name, d in dirs.items()}


# -- (a) rendering ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_rendering_equals_transformers(name, dirs, hf):
    ours, theirs = load_tokenizer(dirs[name]), hf[name]
    for tools in (None, TOOLS):
        for gen in (False, True):
            for messages in (conversation(name), conversation(name)[:3 + EXPECTED[name][5] if EXPECTED[name][5] else 2]):
                text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
                assert text == theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                                          tokenize=False)
                assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen) == \
                    theirs.encode(text, add_special_tokens=False)
    # the tools, both calls and both results reach the rendering (not silently dropped)
    whole = ours.apply_chat_template(conversation(name), tools=TOOLS, tokenize=False)
    shown = {"gemma4": 5, "gpt_oss": 3, "glm45": 5, "kimi_k2": 5, "qwen3_coder": 5, "qwen3": 5, "chatml": 5, "hermes3": 5, "mistral": 5, "deepseek_v3": 5, "deepseek_v31": 5, "llama3": 3}
    wanted = ("Evaluate <x> & 'y'.", "37 + 58", "95", "2 * 3", "6")[:shown.get(name, 0)]
    if name == "deepseek_v3":  # V3-0324's published template never renders the tools' schemas
        assert wanted[0] not in whole
        wanted = wanted[1:]
    assert all(s in whole for s in wanted)


@pytest.mark.parametrize("name", NAMES)
def test_what_axrl_reads_off_the_template(name, dirs, hf):
    tok, theirs = load_tokenizer(dirs[name]), hf[name]
    turn_end, opening, call_start, _, parser, n, form = EXPECTED[name]
    assert tok.eos_token == turn_end and tok.eos_token_id == theirs.convert_tokens_to_ids(turn_end)
    assert tok.eos_token_id in tok.stop_token_ids
    assert tok.generation_prompt_text() == opening
    assert (tok.tool_parser.name if tok.tool_parser else None) == parser and tok.arguments_form == form
    if call_start is None:  # tool-free: said so, not refused
        assert tok.tool_call_format is None and tok.tool_free
        return
    # the learned JSON format where there is one (XML calls have none), else the parser's opening
    assert (tok.tool_call_format.start if tok.tool_call_format else tok.tool_call_start) == call_start
    # the parser's round trip: a reply with N calls, as the template writes them, parses to the same N calls
    parsed = tok.parse_tool_calls(tok.reply_text(calls(name)))
    assert [(c["name"], c["arguments"], c["error"]) for c in parsed] == [("calculator", a, None) for a in ARGS[:n]]


# -- (b) the agent loop's token stream ---------------------------------------------------------------

ANSWERS = dict(zip((a["expression"] for a in ARGS), RESULTS))


class _ToolEnv:
    """Opening system + question; answers tool calls with their results, a reasoning answer with a
    new question, and the last answer by ending. It reads calls the way every env does — as
    ``<tool_call>`` blocks (`env_action` rewrites the template's own format into them)."""

    tools = TOOLS

    def __init__(self, tok) -> None:
        self.tok, self.steps, self.calls = tok, 0, []

    def reset(self, prompt: Prompt) -> list[dict]:
        return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 37 + 58?"}]

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        if self.steps == 1:
            self.calls = parse_tool_calls(action)
            return StepOutcome([hf_tool_result(ANSWERS[c["arguments"]["expression"]], k + 1)
                                for k, c in enumerate(self.calls)])
        if self.steps == 2:
            return StepOutcome([{"role": "user", "content": "And 1 + 1?"}])
        return StepOutcome([], reward=1.0, done=True)


def _episode(tok, replies: list[list[int]]):
    turns = iter(replies)
    engine = ScriptedEngine(lambda prompt: next(turns))
    env = _ToolEnv(tok)
    traj = asyncio.run(run_episode(engine, tok, env, Prompt("p", text="unused"), sample_id=0, group_id=0,
                                   sampling=SamplingParams(max_new_tokens=200, temperature=1.0), max_turns=4,
                                   max_context_len=4096))
    return traj, env, engine


@pytest.mark.parametrize("name", WITH_TOOLS)
def test_agent_loop_trains_exactly_the_generated_ids(name, dirs, hf):
    tok, theirs = load_tokenizer(dirs[name]), hf[name]
    texts = [tok.reply_text(calls(name)), "<think>\nadd\n</think>\n\nThe answer is 95.", "2"]
    n = EXPECTED[name][5]
    # each reply ends with the stop token the model generates there: the call's close, then the turn end
    ends = [tok.token_to_id(CALL_CLOSE.get(name, tok.eos_token)), tok.eos_token_id, tok.eos_token_id]
    replies = [tok.encode(t) + [end] for t, end in zip(texts, ends)]
    traj, env, engine = _episode(tok, replies)
    assert traj.status == "ok" and traj.finish_reason == "stop" and traj.num_turns == 3
    assert [c["name"] for c in env.calls] == ["calculator"] * n      # the env read every call
    ids, mask, turn = traj.token_ids.tolist(), np.asarray(traj.loss_mask), np.asarray(traj.turn)
    # token in, token out: the trained ids of turn i are exactly the ids the engine returned
    for i, reply in enumerate(replies, start=1):
        assert [t for t, m, k in zip(ids, mask, turn) if m and k == i] == reply
    assert int(mask.sum()) == sum(map(len, replies))
    # the prompt is transformers' rendering of the opening, up to the reply's opening
    opening = env.reset(Prompt("p", text="unused"))
    prompt = theirs.apply_chat_template(opening, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ids[:traj.prompt_len] == theirs.encode(prompt, add_special_tokens=False)
    # every request held the stream so far: what the model conditioned on is what is trained
    assert all(ids[:len(r.input_ids)] == list(r.input_ids) for r in engine.requests)
    # the finished chat as transformers renders it: the calls structured, as the loop keeps them
    chat = opening + [tok.reply_message(texts[0]), *[hf_tool_result(RESULTS[k], k + 1) for k in range(n)],
                      {"role": "assistant", "content": texts[1]}, {"role": "user", "content": "And 1 + 1?"},
                      {"role": "assistant", "content": texts[2]}]
    rendered = theirs.encode(theirs.apply_chat_template(chat, tools=TOOLS, tokenize=False), add_special_tokens=False)
    redraws = EXPECTED[name][3]
    if redraws:
        # e.g. Qwen3 strips the earlier <think>, Mistral moves the system prompt and tools to the
        # last question: the stream keeps what the model saw and generated, the difference is drift
        assert rendered[:len(ids)] != ids and traj.drift_tokens > 0
    else:
        assert rendered[:len(ids)] == ids and traj.drift_tokens == 0
    if name == "qwen3":  # what drifted: the stripped reasoning, and the empty think block Qwen3 writes
        # before the calls of the last turn (the model generated it; history re-renders it away)
        think = tok.encode("<think>\nadd\n</think>") + tok.encode("<think>\n\n</think>\n\n")
        assert texts[0].startswith("<think>\n\n</think>\n\n<tool_call>")
        assert len(think) <= traj.drift_tokens <= len(think) + 3
    # the step record carries the drift of white-box samples too (/samples/drift_tokens, metrics)
    from axrl.runtime.recording.builders import _session_columns, _session_metrics
    assert _session_columns([traj]).get("drift_tokens", [0]) == [traj.drift_tokens]
    assert _session_metrics([traj]).get("drift_tokens", 0) == traj.drift_tokens


def test_only_the_stop_tokens_a_template_closes_turns_with_close_a_turn(dirs):
    """Qwen stops generating at `<|endoftext|>` too, but its template closes a turn with `<|im_end|>`:
    a reply ending in `<|endoftext|>` stays open, and the template's close follows it masked (the
    default family's accounting). GLM-4.5 writes nothing after a reply: the `<|observation|>` the
    model generates after its calls closes the turn, and the tool results follow it."""
    qwen = load_tokenizer(dirs["qwen3"])
    assert qwen.reply_close_ids == {qwen.eos_token_id}
    eot = qwen.token_to_id("<|endoftext|>")
    first = qwen.encode(qwen.reply_text(calls("qwen3"))) + [eot]
    traj, env, _ = _episode(qwen, [first, qwen.encode("95") + [qwen.eos_token_id], qwen.encode("2")])
    ids, mask = traj.token_ids.tolist(), np.asarray(traj.loss_mask)
    at = traj.prompt_len + len(first)
    assert ids[at - 1] == eot and ids[at] == qwen.eos_token_id and mask[at - 1] == 1 and mask[at] == 0
    assert [c["name"] for c in env.calls] == ["calculator", "calculator"]
    glm = load_tokenizer(dirs["glm45"])
    observation = glm.token_to_id("<|observation|>")
    assert observation in glm.reply_close_ids and glm.token_to_id("<|user|>") in glm.reply_close_ids
    first = glm.encode(glm.reply_text(calls("glm45"))) + [observation]
    traj, env, _ = _episode(glm, [first, glm.encode("95") + [glm.eos_token_id], glm.encode("2")])
    ids, at = traj.token_ids.tolist(), traj.prompt_len + len(first)
    assert traj.status == "ok" and [c["name"] for c in env.calls] == ["calculator", "calculator"]
    assert ids[at - 1] == observation and glm.decode(ids[at:at + 3]).startswith("\n<tool_response>")


# -- (c) two training steps on the directory -----------------------------------------------------------

TRAIN = ["steps=2", "warmup.steps=0", "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
         "rollout.max_turns=2", "rollout.max_context_len=1024", "data.task_args={show_tool_schema: true}", "eval.every=0", "checkpoint.every=100",
         "runtime.threads=1"]


@pytest.mark.parametrize("name", NAMES)
def test_train_two_steps_and_decode_the_trace(name, dirs, hf, tmp_path):
    run = tmp_path / "run"
    train(run, [f"model.path={dirs[name]}", *TRAIN])
    tok, theirs = load_tokenizer(dirs[name]), hf[name]
    # the manifest records what AxRL chose for the template
    facts = json.loads((run / "manifest.json").read_text())["extra"]["chat_template"]
    assert facts["tool_parser"] == EXPECTED[name][4] and facts["arguments"] == EXPECTED[name][6]
    assert facts["system_folded_by_axrl"] is False and facts["tool_free"] == (EXPECTED[name][2] is None)
    with StepFile(run / "trace" / "step_000001.h5") as sf:
        ids, off = sf["/tokens/ids"].astype(np.int64), sf["/samples/offsets"]
        mask, prompt_len = sf["/tokens/loss_mask"], sf["/samples/prompt_len"]
    assert ids.max() < MODEL_VOCAB
    first = ids[off[0]:off[1]].tolist()
    prompt = tok.decode(first[:int(prompt_len[0])])
    assert prompt == theirs.decode(first[:int(prompt_len[0])])
    # the prompt is this directory's template around the calculator task's system prompt and tools
    marker = "\x00"
    head = theirs.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": marker}], tools=[CALCULATOR_TOOL],
                                      tokenize=False)
    assert prompt.startswith(head[:head.index(marker)]) and prompt.endswith(EXPECTED[name][1])
    gen_ends = [i for i in range(1, len(first)) if mask[off[0] + i - 1] and not mask[off[0] + i]]
    assert all(first[i - 1] in tok.stop_token_ids for i in gen_ends)  # turns close with this template's tokens
    from axrl_debug.tui.data import RunModel  # what axrl-debug decodes the run's trace with
    assert RunModel(run).tokenizer.decode(first) == theirs.decode(first)


# -- refusal and check-template ------------------------------------------------------------------------

def _with_template(src: Path, dst: Path, template: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dst


NO_SYSTEM = ("{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + CONVENTIONS["gemma"].template)
FLAT_CALLS = CONVENTIONS["chatml"].template.replace("call.function.", "call.")


def test_a_template_axrl_cannot_follow_is_refused_naming_the_feature(dirs, tmp_path):
    bad = _with_template(dirs["chatml"], tmp_path / "bad", FLAT_CALLS)
    feature, advice = "cannot render an assistant tool call in the Hugging Face form", "read the call as tool_call.function"
    with pytest.raises(ValueError) as err:
        load_tokenizer(bad)
    assert feature in str(err.value) and advice in str(err.value) and "check-template" in str(err.value)
    result = axrl("model", "check-template", bad)
    assert result.exit_code == 2 and "refused" in result.output and feature in result.output
    assert "Traceback" not in result.output


def test_a_template_without_a_system_role_gets_the_system_prompt_folded(dirs, hf, tmp_path):
    """Gemma 2's published template raises on a system message; Google documents putting the
    instructions in the first user turn, which AxRL then does (and says so)."""
    d = _with_template(dirs["gemma"], tmp_path / "nosys", NO_SYSTEM)
    tok, theirs = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(str(d))
    assert tok.fold_system
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    folded = [{"role": "user", "content": "Be terse.\n\nHi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(folded, add_generation_prompt=True, tokenize=False)
    result = axrl("model", "check-template", d)
    assert result.exit_code == 0 and "AxRL folds the system prompt into the first user turn" in result.output


def test_a_template_that_raises_on_a_parameter_gets_a_verdict_not_a_traceback(dirs, tmp_path):
    """A check tool must never crash: whatever the template raises is quoted in the verdict."""
    boom = "{{ raise_exception('this template is broken on purpose') }}"
    d = _with_template(dirs["chatml"], tmp_path / "boom", boom)
    result = axrl("model", "check-template", d)
    assert result.exit_code == 2 and "this template is broken on purpose" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma"])
def test_check_template_says_what_axrl_does(name, dirs):
    result = axrl("model", "check-template", dirs[name])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "AxRL can follow it" in out and "renders the sample conversation identically" in out
    assert f"turn end       {EXPECTED[name][0]!r}" in out
    if name == "qwen3":
        assert "stripped from turns before the last question" in out and "recorded as drift" in out
    if name == "llama3":
        assert "bare JSON" in out and "ipython" in out and "no drift" in out
    if name == "gemma":
        assert "folded into a user turn" in out and "no drift" in out


def test_the_existing_qwen_style_checkpoint_still_loads(tmp_path):
    d = write_checkpoint(tmp_path / "qwen", moe=False)
    result = axrl("model", "check-template", d)
    assert result.exit_code == 0 and "identically" in result.output, result.output


@pytest.mark.parametrize("name", WITH_TOOLS)
def test_the_calculator_env_reads_tool_calls_in_every_template_format(name, dirs):
    """A reply whose tool call is written the template's way (bare JSON, `[TOOL_CALLS]`, name
    outside the JSON …) reaches the calculator env as calls it executes: `env_action` rewrites
    them into the `<tool_call>` blocks envs read, the prose before them kept."""
    from axrl.agents.env import env_action
    from axrl.agents.tasks.calculator import CalculatorEnv

    tok = load_tokenizer(dirs[name])
    reply = tok.reply_text({"role": "assistant", "content": "",
                            "tool_calls": [tok.tool_call_message("calculator", {"expression": "37 + 58"}, 1)]})
    env = CalculatorEnv()
    env.reset(Prompt("p", text="What is 37 + 58?", fields={"answer": 95}))
    outcome = env.step(env_action(tok, reply))
    assert not outcome.done and [m["content"] for m in outcome.observation] == ["95"], (reply, outcome)
    assert env_action(tok, "The answer is 95.") == "The answer is 95."   # no call: the text as it is


def test_qwen3_calls_are_read_after_the_empty_think_block_and_after_reasoning(dirs):
    """Qwen3's published template writes `<think>\\n\\n</think>\\n\\n` before the calls of the last
    turn: the call's start tag is still `<tool_call>`, two calls parse as two, and a call after
    real reasoning parses as one (the reasoning is split off and kept apart)."""
    tok = load_tokenizer(dirs["qwen3"])
    assert tok.tool_parser.name == "hermes" and tok.reasoning_parser == "think"
    assert tok.tool_call_format.start == "<tool_call>" and tok.tool_call_start == "<tool_call>"
    two = tok.reply_text(calls("qwen3"))
    assert [c["name"] for c in tok.parse_tool_calls(two)] == ["calculator", "calculator"]
    after = "<think>\nI add them.\n</think>\n\n" + two.split("</think>\n\n", 1)[1].split("\n<tool_call>")[0]
    read = tok.parse_tool_calls(after)
    assert [(c["name"], c["arguments"]) for c in read] == [("calculator", {"expression": "37 + 58"})]
    assert tok.split_reasoning(after)[0] == "I add them."
    out = axrl("model", "check-template", dirs["qwen3"]).output
    assert "rendered into the call's turn" not in out and "tool parser    hermes" in out, out


def test_model_tool_parser_overrides_the_parser_read_off_the_template(dirs):
    """`model.tool_parser` (vLLM's names) replaces the detected parser; an unknown name is refused
    naming the key and the choices."""
    from axrl.config import Config

    assert Config.model_validate({"model": {"tool_parser": "pythonic"}}).model.tool_parser == "pythonic"
    tok = load_tokenizer(dirs["chatml"], "pythonic")
    assert tok.tool_parser.name == "pythonic"
    assert [(c["name"], c["arguments"]) for c in tok.parse_tool_calls('[calculator(expression="1 + 1")]')] == [
        ("calculator", {"expression": "1 + 1"})]
    with pytest.raises(ValueError, match="model.tool_parser: unknown tool-call parser 'nope'"):
        load_tokenizer(dirs["chatml"], "nope")


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_field_aliases_render_as_transformers_does(field, dirs, hf):
    """A client may send an assistant message's reasoning as `reasoning_content`, `thinking` or
    `reasoning`: transformers 5 fills the others from it, so the Qwen3 template (which reads
    `reasoning_content`) renders it whichever name is used, and AxRL renders the same."""
    tok, theirs = load_tokenizer(dirs["qwen3"]), hf["qwen3"]
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4", field: "add two and two"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert "<think>\nadd two and two\n</think>" in text
    assert text == theirs.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("name", ["gpt_oss", "glm45"])
def test_check_template_follows_templates_whose_turns_close_otherwise(name, dirs):
    """gpt-oss closes a call's turn with <|call|> and a final answer with <|return|> (<|end|> in
    history); GLM-4.5 writes nothing after a reply. check-template follows both: the family's
    parser is chosen from the call the template writes, the rendering equals transformers."""
    result = axrl("model", "check-template", dirs[name])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "AxRL can follow it" in result.output and "identically" in result.output
    assert f"tool parser    {EXPECTED[name][4]}" in result.output
    assert "tool list      rendered into the prompt" in result.output


def test_check_template_says_when_the_tools_never_reach_the_prompt(dirs):
    """DeepSeek-V3(-0324)'s published template renders calls and results but never the `tools`:
    check-template says so (the run still loads), so a user can put the schemas in the system prompt."""
    result = axrl("model", "check-template", dirs["deepseek_v3"])
    assert result.exit_code == 0 and "AxRL can follow it" in result.output, result.output
    assert "tool list      NOT rendered" in result.output and "system prompt" in result.output


def test_a_gpt_oss_reply_becomes_the_message_its_template_reads(dirs, hf):
    """gpt-oss's published template refuses `<|channel|>` inside `content`: a reply is kept as the
    analysis channel in `thinking`, the final channel in `content`, a call as `tool_calls`, and the
    kept conversation renders as transformers renders it."""
    tok = load_tokenizer(dirs["gpt_oss"])
    final = tok.reply_message("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final"
                              "<|message|>95")
    assert final == {"role": "assistant", "content": "95", "thinking": "Add them."}
    call = tok.reply_message('<|channel|>analysis<|message|>Use it.<|end|><|start|>assistant to=functions.calculator'
                             '<|channel|>commentary <|constrain|>json<|message|>{"expression": "37 + 58"}')
    assert call["content"] == "" and call["thinking"] == "Use it."
    assert [c["function"]["name"] for c in call["tool_calls"]] == ["calculator"]
    chat = [{"role": "user", "content": "What is 37 + 58?"}, call, hf_tool_result("95", 1), final]
    assert "<|channel|>analysis<|message|><|channel|>" not in tok.apply_chat_template(chat, tokenize=False)
    assert tok.apply_chat_template(chat, tokenize=False) == hf["gpt_oss"].apply_chat_template(chat, tokenize=False)
