"""The tool-call parser registry (axrl.tokenizer.tool_parsers) and the reasoning parsers: for each
family, several calls in one reply, a call after reasoning, arguments that contain the family's
own delimiters, and malformed calls (recorded with an error, never a crash)."""

from __future__ import annotations

import json

import pytest

from axrl.tokenizer.reasoning import split_reasoning
from axrl.tokenizer.tool_parsers import PARSERS, detect_tool_parser, get_tool_parser

# Each family's delimiters, inside argument values: a parser that splits on them naively breaks.
NASTY = {
    "hermes": "a </tool_call> b",
    "llama3_json": 'a }; {"name": "x"} b',
    "mistral": "a [TOOL_CALLS] b ]",
    "deepseek_v3": "a ``` b",
    "deepseek_v31": "a <｜tool▁sep｜> b",
    "qwen3_coder": "a <parameter=z> b",
    "pythonic": "a), b(c=1",
    "openai": "a <|message|> b",
    "kimi_k2": "a <|tool_call_argument_begin|> b",
    "glm45": "a <arg_key> b",
    "gemma4": "a }<tool_call|>, b:{c} <|tool_call>call:x{",
}


def write(family: str, calls: list[tuple[str, dict]]) -> str:
    """A reply with ``calls`` in ``family``'s format, as the model writes it after its prompt."""
    j = json.dumps
    if family == "hermes":
        return "\n".join(f'<tool_call>\n{j({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    if family == "llama3_json":
        return "; ".join(j({"name": n, "parameters": a}) for n, a in calls)
    if family == "mistral":
        return "[TOOL_CALLS]" + j([{"name": n, "arguments": a, "id": f"abcdefgh{k}"} for k, (n, a) in enumerate(calls)])
    if family == "deepseek_v3":
        inner = "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{j(a)}\n```<｜tool▁call▁end｜>"
                        for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"
    if family == "deepseek_v31":
        inner = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{j(a)}<｜tool▁call▁end｜>" for n, a in calls)
        return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"
    if family == "qwen3_coder":
        return "\n".join("<tool_call>\n<function=" + n + ">\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else j(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>" for n, a in calls)
    if family == "pythonic":
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"
    if family == "openai":
        return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{j(a)}"
                       "<|call|>" for n, a in calls)
    if family == "kimi_k2":
        inner = "".join(f"<|tool_call_begin|>functions.{n}:{k}<|tool_call_argument_begin|>{j(a)}<|tool_call_end|>"
                        for k, (n, a) in enumerate(calls))
        return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"
    if family == "glm45":
        return "".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else j(v)}"
                                                     "</arg_value>\n" for k, v in a.items()) + "</tool_call>"
                       for n, a in calls)
    if family == "gemma4":  # strings between <|"|> tokens, other values bare
        value = lambda v: f'<|"|>{v}<|"|>' if isinstance(v, str) else j(v)  # noqa: E731
        return "".join(f"<|tool_call>call:{n}{{" + ",".join(f"{k}:{value(v)}" for k, v in a.items()) + "}<tool_call|>"
                       for n, a in calls)
    raise KeyError(family)


REASONING = {"openai": ("<|channel|>analysis<|message|>I should add.<|end|>", "openai"),
             "gemma4": ("<|channel>thought\nI should add.<channel|>", "gemma4"),
             "default": ("<think>\nI should add.\n</think>\n\n", "think")}
CALLS = [("calculator", {"expression": "37 + 58"}), ("search", {"query": "x", "n": 3}),
         ("calculator", {"expression": "2 * 3"})]


def parsed(family: str, text: str) -> list[tuple]:
    return [(c["name"], c["arguments"], c["error"]) for c in get_tool_parser(family).parse(text)]


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_several_calls_in_one_reply(family):
    assert parsed(family, write(family, CALLS)) == [(n, a, None) for n, a in CALLS]


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_a_call_after_reasoning(family):
    thought, kind = REASONING.get(family, REASONING["default"])
    text = thought + write(family, CALLS[:1])
    reasoning, rest = split_reasoning(text, kind)
    assert reasoning == "I should add."
    assert parsed(family, rest) == [(*CALLS[0], None)]


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_arguments_containing_the_delimiters(family):
    calls = [("echo", {"text": NASTY[family]}), ("calculator", {"expression": "1 + 1"})]
    assert parsed(family, write(family, calls)) == [(n, a, None) for n, a in calls]


MALFORMED = {
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',
    "llama3_json": '{"name": "calculator", "parameters": {"expression": "1"',
    "mistral": '[TOOL_CALLS][{"name": "calculator", "arguments": {',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{oops}\n```"
                   "<｜tool▁call▁end｜>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{\"expression\": ",
    "qwen3_coder": "<tool_call>\n<function=calculator>\n<parameter=expression>\n1 + 1\n",
    "pythonic": "[calculator(expression='1 + 1'",
    "openai": "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{\"expression\": <|call|>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>{",
    "glm45": "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1",
    "gemma4": '<|tool_call>call:calculator{expression:<|"|>1 + 1',
}


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_a_malformed_call_is_recorded_not_raised(family):
    calls = get_tool_parser(family).parse(MALFORMED[family])
    assert len(calls) == 1 and calls[0]["error"], calls
    assert calls[0]["arguments"] is None and isinstance(calls[0]["raw"], str)
    # a good call before the malformed one is still read
    if family not in ("llama3_json", "pythonic", "mistral"):
        good = get_tool_parser(family).parse(write(family, CALLS[:1]) + MALFORMED[family])
        assert [c["error"] is None for c in good] == [True, False]


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_prose_is_no_call(family):
    assert get_tool_parser(family).parse("The answer is {95} [x] (y).") == []


def test_an_unknown_parser_name_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"model.tool_parser: unknown tool-call parser 'hermes2'.*qwen3_coder"):
        get_tool_parser("hermes2")


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_the_family_is_recognised_from_a_rendered_call(family):
    assert detect_tool_parser(write(family, [("probe", {"x": 1})])) == family


def test_reasoning_after_an_opened_block_and_unclosed_reasoning():
    # R1 distills: the generation prompt opened <think>, the reply starts inside it
    assert split_reasoning("mull it\n</think>\n\nThe answer.", "think", opened=True) == ("mull it", "The answer.")
    assert split_reasoning("<think>cut off while thinking", "think") == ("cut off while thinking", "")
    assert split_reasoning("No reasoning here.", "think") == ("", "No reasoning here.")
    assert split_reasoning("Prose <think>not reasoning</think>", "think")[0] == ""


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_every_parser_pickles(family):
    """Tokenizers (and so their parsers) travel to rollout workers by pickle."""
    import pickle

    parser = pickle.loads(pickle.dumps(get_tool_parser(family)))
    assert parsed(family, write(family, CALLS[:1])) == [(c["name"], c["arguments"], c["error"])
                                                        for c in parser.parse(write(family, CALLS[:1]))]


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45"])
def test_xml_values_are_typed_by_the_tools_json_schema(family):
    """XML formats carry every value as text: with the request's tools, a `string` parameter keeps
    its text ("95" stays "95", "true" stays "true") while an `integer` one reads as a number;
    without tools the value is guessed from the text."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "flag": {"type": "string"}, "count": {"type": "integer"}}}}}]
    if family == "qwen3_coder":
        text = ("<tool_call>\n<function=lookup>\n<parameter=code>\n95\n</parameter>\n<parameter=flag>\ntrue\n"
                "</parameter>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>")
    else:
        text = ("<tool_call>lookup\n<arg_key>code</arg_key>\n<arg_value>95</arg_value>\n<arg_key>flag</arg_key>\n"
                "<arg_value>true</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    parser = get_tool_parser(family)
    assert parser.parse_calls(text, tools)[0]["arguments"] == {"code": "95", "flag": "true", "count": 3}
    assert parser.parse_calls(text)[0]["arguments"] == {"code": 95, "flag": True, "count": 3}


def test_qwen3_coder_values_written_as_python_literals_round_trip(tmp_path):
    """Qwen3-Coder's published template writes a non-string value with Jinja's `string` filter
    (Python's `str`: `True`, `{'a': 1}`, `[1, 'x']`): what a model trained on it writes parses back
    to the call's own arguments, typed by the schema where the request has tools and guessed where
    not; a `string` parameter keeps its text, and Python-only spellings (`0x10`, sets) stay text."""
    from template_models import CONVENTIONS, write_convention_dir

    from axrl.tokenizer import load_tokenizer

    tok = load_tokenizer(write_convention_dir(tmp_path / "coder", CONVENTIONS["qwen3_coder"]))
    args = {"flag": True, "off": False, "opts": {"a": 1, "b": "x"}, "n": 3, "xs": [1, "x"], "code": "95"}
    kinds = {"flag": "boolean", "off": "boolean", "opts": "object", "n": "integer", "xs": "array", "code": "string"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        k: {"type": v} for k, v in kinds.items()}}}}]
    text = tok.reply_text({"role": "assistant", "content": "", "tool_calls": [tok.tool_call_message("f", args, 1)]})
    assert "<parameter=flag>\nTrue\n" in text and "{'a': 1, 'b': 'x'}" in text  # the template's quirk
    assert tok.parse_tool_calls(text, tools=tools)[0]["arguments"] == args
    assert tok.parse_tool_calls(text)[0]["arguments"] == {**args, "code": 95}
    odd = "<tool_call>\n<function=f>\n<parameter=n>\n0x10\n</parameter>\n<parameter=s>\n{1, 2}\n</parameter>\n</function>\n</tool_call>"
    assert parsed("qwen3_coder", odd) == [("f", {"n": "0x10", "s": "{1, 2}"}, None)]


def test_gemma4_values_nest_and_keep_their_types():
    """Gemma 4 writes mappings and lists in its own syntax: they come back as JSON values; a reply
    whose thought channel was cut off by a call ends the reasoning there, as vLLM reads it."""
    text = ('<|tool_call>call:lookup{codes:[1,<|"|>a, b<|"|>],flag:true,opts:{<|"|>k<|"|>:2.5,deep:{x:null}}}'
            "<tool_call|>")
    assert parsed("gemma4", text) == [("lookup", {"codes": [1, "a, b"], "flag": True,
                                                  "opts": {"k": 2.5, "deep": {"x": None}}}, None)]
    assert split_reasoning("<|channel>thought\nhmm" + text, "gemma4") == ("hmm", text)
