"""Tests for axrl.tokenizer: round trips, special ids, HF parity, incremental chat encoding,
builder determinism and tool-call parsing."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from axrl.tokenizer import Tokenizer, parse_tool_calls
from axrl.tokenizer.build import ASSETS_DIR, VOCAB_SIZE, build
from axrl.tokenizer.chat_template import SPECIAL_TOKENS
from axrl.tokenizer.tool_calls import ToolCallFormat, parse_with_format

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression; <b>, & and 'quotes' must not be escaped.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]

CONVERSATION = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 37 + 58? Ünïcödé ✓"},
    {"role": "assistant", "content": "Let me use the calculator.",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                     "arguments": {"expression": "37 + 58"}}}]},
    {"role": "tool", "content": "95"},
    # content=None (OpenAI style), two calls, one with string-serialised arguments
    {"role": "assistant", "content": None,
     "tool_calls": [{"name": "calculator", "arguments": "{\"expression\": \"95 * 2\"}"},
                    {"name": "calculator", "arguments": {"expression": "95 - 1"}}]},
    {"role": "tool", "content": "190"},
    {"role": "tool", "content": "94"},
    {"role": "assistant", "content": "The answer is 95."},
]

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "What is 37 + 58? The answer is 95. 12*(3-4)/0.5 = -24",
    '{"name": "calculator", "arguments": {"expression": "37 + 58"}}',
    "héllo wörld — 世界 🎉 𝔘𝔫𝔦 \u200b e\u0301",  # includes a decomposed é: no normalisation
    "  leading, trailing  \n\n\t\tmixed   whitespace runs   \r\n ",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def hf_tok(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory):
    import transformers  # the test extra installs it
    d = tok.save(tmp_path_factory.mktemp("hf_tok"))
    return transformers.AutoTokenizer.from_pretrained(str(d))


def _ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list
    return list(out) if isinstance(out, list) else list(out["input_ids"])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_recognised_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == tok.im_start_id and ids[-1] == tok.im_end_id
    assert tok.token_to_id("<tool_call>") in ids and tok.token_to_id("</tool_call>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nx"


def test_digits_are_single_tokens(tok: Tokenizer) -> None:
    for d in "0123456789":
        assert len(tok.encode(d)) == 1
    ids = tok.encode("1234567890")
    assert [tok.decode([i]) for i in ids] == list("1234567890")
    # digits stay separate inside words and next to spaces/operators too
    pieces = [tok.decode([i]) for i in tok.encode("x12 + 345=abc678")]
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))


def test_special_ids_and_vocab_size(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE == 1024
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(7))
    assert SPECIAL_TOKENS[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert (tok.pad_token_id, tok.im_start_id, tok.im_end_id, tok.eos_token_id) == (0, 1, 2, 2)
    assert tok.special_token_ids == list(range(7))
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("no such token") is None


def test_encoding_is_compact_on_task_text(tok: Tokenizer) -> None:
    # the corpus should have taught merges for the task's vocabulary (words, JSON keys)
    assert len(tok.encode("The answer is")) == 3
    assert len(tok.encode('{"name": "calculator", "arguments": {"expression": "')) < 16


def test_hf_load_and_encode_parity(tok: Tokenizer, hf_tok) -> None:
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (2, 0, None)
    assert len(hf_tok) == tok.vocab_size
    for text in TEXTS:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf_tok(text)["input_ids"] == tok.encode(text)  # no BOS/EOS added by default
        assert hf_tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_hf_chat_template_parity(tok: Tokenizer, hf_tok, tools, add_generation_prompt: bool) -> None:
    kw = {"tools": tools, "add_generation_prompt": add_generation_prompt}
    ours = tok.apply_chat_template(CONVERSATION, tokenize=False, **kw)
    assert ours == hf_tok.apply_chat_template(CONVERSATION, tokenize=False, **kw)
    assert tok.apply_chat_template(CONVERSATION, **kw) == _ids(hf_tok.apply_chat_template(CONVERSATION, **kw))
    # conversation without a system message: the tools get a system block of their own
    assert tok.apply_chat_template(CONVERSATION[1:], tokenize=False, **kw) == \
        hf_tok.apply_chat_template(CONVERSATION[1:], tokenize=False, **kw)


def test_rendered_format(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATION[1:4], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nWhat is 37 + 58? Ünïcödé ✓<|im_end|>\n"
        "<|im_start|>assistant\nLet me use the calculator.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "37 + 58"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n95\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_tools = tok.apply_chat_template(CONVERSATION[:1], tools=TOOLS, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nYou are a careful math tutor.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in with_tools  # no HTML escaping by tojson
    assert with_tools.count("<|im_start|>") == 1


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("start", [0, 1])  # with and without a leading system message
def test_incremental_encoding_matches_template(tok: Tokenizer, tools, start: int) -> None:
    msgs = CONVERSATION[start:]
    stream: list[int] = []
    for i, m in enumerate(msgs):
        stream += tok.encode_message(m, tools=tools if i == 0 else None)
        # prefix-stable: every partial conversation is a prefix of the stream so far
        assert stream == tok.apply_chat_template(msgs[: i + 1], tools=tools)
    stream += tok.generation_prompt_ids()
    assert stream == tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True)


def test_generation_prompt_opens_assistant_message(tok: Tokenizer) -> None:
    gen = tok.generation_prompt_ids()
    assert tok.decode(gen) == "<|im_start|>assistant\n" and gen[0] == tok.im_start_id
    msg = tok.encode_message({"role": "assistant", "content": "The answer is 95."})
    assert msg[: len(gen)] == gen and msg[-2:] == [tok.im_end_id] + tok.encode("\n")


def test_save_load_roundtrip_and_pickle(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    again = Tokenizer.from_dir(tmp_path)
    assert again.chat_template == tok.chat_template
    assert again.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)


def test_loads_hf_saved_dir(tok: Tokenizer, hf_tok, tmp_path: Path) -> None:
    # transformers writes the template to chat_template.jinja; from_dir must pick it up
    hf_tok.save_pretrained(str(tmp_path))
    again = Tokenizer.from_dir(tmp_path)
    assert again.apply_chat_template(CONVERSATION, tools=TOOLS) == tok.apply_chat_template(CONVERSATION, tools=TOOLS)


def test_builder_is_deterministic(tmp_path: Path) -> None:
    out = build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ASSETS_DIR / name).read_bytes(), \
            f"{name} differs from the shipped asset: rerun `python -m axrl.tokenizer.build`"


def test_parse_tool_calls_good() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "37 + 58"}}\n</tool_call>\n'
        '<tool_call>{"function": {"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c["name"], c["arguments"], c["error"]) for c in calls] == [
        ("calculator", {"expression": "37 + 58"}, None),
        ("calculator", {"expression": "2"}, None),
    ]
    assert calls[0]["raw"].startswith('{"name"')
    assert parse_tool_calls("The answer is 95.") == []
    no_args = parse_tool_calls('<tool_call>{"name": "clock"}</tool_call>')
    assert no_args[0]["arguments"] == {} and no_args[0]["error"] is None


@pytest.mark.parametrize("body, closed, keeps_name", [
    ('{"name": "calculator", "arguments": {"expression": "1 +', True, False),  # truncated JSON
    ("not json at all", True, False),
    ('["calculator"]', True, False),                                          # not an object
    ('{"arguments": {}}', True, False),                                       # no name
    ('{"name": "calculator", "arguments": "{bad"}', True, True),              # bad string args
    ('{"name": "calculator", "arguments": [1, 2]}', True, True),              # args not an object
    ('{"name": "calculator", "arguments": {"expression": "1"}}', False, False),  # unterminated
])
def test_parse_tool_calls_bad(body: str, closed: bool, keeps_name: bool) -> None:
    text = "<tool_call>\n" + body + ("\n</tool_call>" if closed else "")
    (call,) = parse_tool_calls(text)
    assert call["error"] and call["arguments"] is None and call["raw"] == body
    assert (call["name"] == "calculator") == keeps_name


def test_parse_tool_calls_from_decoded_generation(tok: Tokenizer) -> None:
    ids = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>')
    ids.append(tok.im_end_id)
    (call,) = parse_tool_calls(tok.decode(ids))
    assert call["error"] is None and call["arguments"] == {"expression": "6 * 7"}


MISTRAL, LLAMA = ToolCallFormat("[TOOL_CALLS]", ""), ToolCallFormat("", "")
DEEPSEEK = ToolCallFormat("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "```<｜tool▁call▁end｜>", name_sep="\n```json\n")


@pytest.mark.parametrize("fmt, text, expected", [
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{}"}]',
     [("f", {"a": 1}, None), ("g", {}, None)]),
    (MISTRAL, "[TOOL_CALLS] [{oops", [(None, None, "invalid JSON after the tool call start")]),
    (MISTRAL, "no calls here", []),
    (LLAMA, '{"name": "f", "parameters": {"a": 1}}{"name": "g", "parameters": {}}', [("f", {"a": 1}, None),
                                                                                    ("g", {}, None)]),
    (LLAMA, 'The set {"name": "f"} is not a call: prose comes first', []),
    (DEEPSEEK, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜>'
               '<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     [("f", {"a": 1}, None), ("g", {}, None)]),
    (DEEPSEEK, '<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}',
     [("f", {"a": 1}, "unterminated tool call (no '```<｜tool▁call▁end｜>')")]),
])
def test_parse_with_format(fmt: ToolCallFormat, text: str, expected: list) -> None:
    """The untagged formats templates write: a start tag and a JSON list (Mistral), bare JSON
    (Llama), the name outside the JSON (DeepSeek-V3); malformed calls are reported, not raised."""
    assert [(c["name"], c["arguments"], c["error"]) for c in parse_with_format(text, fmt)] == expected
