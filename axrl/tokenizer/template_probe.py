"""What AxRL reads off a chat template, and the templates it refuses.

Every probe passes messages in the Hugging Face convention (the one transformers documents and
Llama / Mistral / Qwen templates read): assistant ``tool_calls`` as
``[{"type": "function", "id", "function": {"name", "arguments"}}]``, ``tool`` messages with a
``tool_call_id``, ``tools`` as OpenAI JSON-schema functions. A template that cannot render one of
these shapes is refused at load with the shape named and what to do about it.
"""

from __future__ import annotations

from typing import Any, Callable

from axrl.tokenizer.tool_calls import ToolCallFormat, _json_at, hf_tool_call, hf_tool_result

Message = dict[str, Any]
Render = Callable[..., str]  # render(messages, tools=..., add_generation_prompt=...) -> text

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe", "description": "A probe tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
PROBE_CALL = hf_tool_call("probe", {"x": 1}, 1)
# A conversation shaped like an agent episode: system, question, tool call, its result, answer.
EPISODE: list[Message] = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
    hf_tool_result("r", 1), {"role": "assistant", "content": "a"}]

# (feature, messages, with tools, what to do): probed in order, the first that fails is named.
_USER = {"role": "user", "content": "u"}
SHAPES: list[tuple[str, list[Message], bool, str]] = [
    ("a user message", [_USER], False, "AxRL renders every prompt as chat messages"),
    ("a system message", [{"role": "system", "content": "s"}, _USER], False,
     "AxRL's tasks open with a system message; make the template fold it into the first user turn "
     "(as Gemma's does) instead of raising"),
    ("an assistant reply", [_USER, {"role": "assistant", "content": "a"}], False,
     "the agent loop appends every reply to the conversation"),
    ("a tools list (tools=[{type: function, function: {name, description, parameters}}])",
     [_USER], True, "tool-using tasks pass their schemas this way; render them (or ignore them) without raising"),
    ("an assistant tool call in the Hugging Face form (tool_calls=[{type: function, id, "
     "function: {name, arguments}}], read as tool_call.function.name)",
     [_USER, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}], False,
     "read the call as tool_call.function (transformers' convention); a template written for flat "
     "{name, arguments} calls needs that one change"),
    ("a tool result (role 'tool' with tool_call_id, after the call)",
     [_USER, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}, hf_tool_result("r", 1)], False,
     "tool results come back as role 'tool' messages; render them (Llama: as ipython turns, Gemma: as user "
     "turns) instead of raising"),
]


def check_shapes(render: Render, source: str) -> None:
    """Raise ValueError naming the first Hugging Face message shape the template cannot render."""
    for feature, messages, with_tools, advice in SHAPES:
        try:
            render(messages, tools=[PROBE_TOOL] if with_tools else None, add_generation_prompt=True)
        except Exception as e:  # the template's own raise_exception or a Jinja error
            raise ValueError(f"{source}: the chat template cannot render {feature}: {e}. AxRL cannot follow "
                             f"this template: {advice} (check it with `axrl model check-template DIR`; "
                             "docs/models.md lists the conventions AxRL follows)") from None


def tool_call_format(render: Render, generation_prompt: str, eos_token: str) -> ToolCallFormat | None:
    """How the template writes a tool call (see :class:`ToolCallFormat`), from its rendering of
    one probe call; None when it writes none that AxRL can read (e.g. it drops ``tool_calls``)."""
    messages = [_USER, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}]
    text, before = render(messages), render(messages[:1], add_generation_prompt=True)
    if not text.startswith(before) or eos_token not in text[len(before):]:
        return None
    body = text[len(before):text.rindex(eos_token)]
    for pos in (i for i, ch in enumerate(body) if ch in "[{"):
        found = _json_at(body, pos)
        if found is None:
            continue
        value, stop = found
        first = value[0] if isinstance(value, list) and value else value
        if isinstance(first, dict) and first.get("name") == "probe":  # {"name", "arguments"} JSON
            return ToolCallFormat(body[:pos].strip(), body[stop:].strip())
        if value == {"x": 1} and "probe" in body[:pos]:  # the name before its arguments (DeepSeek)
            at = body.rindex("probe", 0, pos)
            start, end = _per_call(render, messages, before, eos_token, body[:at], body[stop:])
            return ToolCallFormat(start.strip(), end.strip(), name_sep=body[at + len("probe"):pos])
    return None


def _per_call(render: Render, messages: list[Message], before: str, eos_token: str, opening: str,
              closing: str) -> tuple[str, str]:
    """The text around *each* call when the template also wraps the whole list (DeepSeek's
    <｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>): a two-call rendering shows what sits between
    two calls, which is one call's close followed by the next one's opening."""
    two = [messages[0], {**messages[1], "tool_calls": [PROBE_CALL, PROBE_CALL]}]
    body = render(two)[len(before):]
    first = body.find('{"x": 1}')
    between = body[first + len('{"x": 1}'):body.find("probe", first)] if first >= 0 else ""
    fits = [k for k in range(len(between), -1, -1) if closing.startswith(between[:k]) and opening.endswith(between[k:])]
    # Split between two markers (`…end｜><｜begin…`), not inside one that merely shares letters.
    tidy = [k for k in fits if k in (0, len(between)) or between[k] in "<[" or between[k - 1] == "\n"]
    k = (tidy or fits or [None])[0]
    return (opening, closing) if k is None else (between[k:], between[:k])
