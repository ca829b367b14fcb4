"""What AxRL reads off a chat template, and the templates it refuses.

Every probe passes messages in the Hugging Face convention (the one transformers documents and
Llama / Mistral / Qwen templates read): assistant ``tool_calls`` as
``[{"type": "function", "id", "function": {"name", "arguments"}}]``, ``tool`` messages with a
``tool_call_id``, ``tools`` as OpenAI JSON-schema functions. A template that cannot render one of
these shapes is refused at load with the shape named and what to do about it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from axrl.tokenizer.tool_calls import ToolCallFormat, _json_at, call_id, hf_tool_call, hf_tool_result
from axrl.tokenizer.tool_parsers import detect_tool_parser, get_tool_parser

Message = dict[str, Any]
Render = Callable[..., str]  # render(messages, tools=..., add_generation_prompt=...) -> text

PROBE_TOOL = {"type": "function", "function": {
    "name": "probe", "description": "A probe tool.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
PROBE_ARGS = {"x": 1}
_USER = {"role": "user", "content": "u"}


def probe_call(form: str, index: int = 1) -> Message:
    """The probe call with its arguments as the OpenAI wire's JSON string (``form`` "string") or
    as a mapping ("mapping")."""
    return hf_tool_call("probe", json.dumps(PROBE_ARGS) if form == "string" else dict(PROBE_ARGS), index)


def episode(form: str) -> list[Message]:
    """A conversation shaped like an agent episode: system, question, tool call, its result, answer."""
    return [{"role": "system", "content": "s"}, _USER,
            {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]},
            hf_tool_result("r", 1), {"role": "assistant", "content": "a"}]


def arguments_form(render: Render) -> tuple[str | None, str]:
    """How the template wants a call's ``arguments``: "string" (the OpenAI wire form, which
    DeepSeek-V3.1 concatenates as text), else "mapping" (transformers' documented form, which
    templates that ``tojson`` the arguments need: a string would be encoded twice). (None, the
    template's error) when it renders neither."""
    error = ""
    for form in ("string", "mapping"):
        try:
            text = render([_USER, {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]}],
                          tools=[PROBE_TOOL])
        except Exception as e:  # the template's own raise_exception, or a Jinja TypeError
            error = error or f"{type(e).__name__}: {e}"
            continue
        if form == "string" and '\\"x\\"' in text:
            continue  # the template serialised the string again: it wants a mapping
        if form == "string" and _reads_back(render, "mapping") and not _reads_back(render, "string"):
            continue  # a known family's format that only a mapping fills (GLM-4.5: <arg_key>x</arg_key>)
        return form, ""
    return None, error


def _reads_back(render: Render, form: str) -> bool:
    """Whether the call rendered with ``form`` arguments parses back, by the family parser its
    text matches, to the probe's name and arguments."""
    try:
        text = render([_USER, {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]}],
                      tools=[PROBE_TOOL])
        body = text[len(whole_markers(os.path.commonprefix([text, render([_USER], tools=[PROBE_TOOL],
                                                                        add_generation_prompt=True)]))):]
    except Exception:  # the template refuses this form
        return False
    name = detect_tool_parser(body)
    calls = get_tool_parser(name).parse(body) if name else []
    return any(c.get("name") == "probe" and c.get("arguments") == PROBE_ARGS for c in calls)


def _try(render: Render, messages: list[Message], with_tools: bool) -> str | None:
    """None when the template renders ``messages``, else its error as it raised it."""
    try:
        render(messages, tools=[PROBE_TOOL] if with_tools else None, add_generation_prompt=True)
    except Exception as e:  # the template's own raise_exception or a Jinja error
        return f"{type(e).__name__}: {e}" if not str(e).startswith(type(e).__name__) else str(e)
    return None


@dataclass
class Shapes:
    """What a template renders: ``form`` of call arguments (None: no tool calls), whether AxRL
    folds the system prompt into the first user turn (the template has no system role), and why
    the template is tool-free (empty when it renders calls)."""

    form: str | None
    fold_system: bool = False
    tool_free: str = ""


def _refuse(source: str, feature: str, error: str, advice: str) -> ValueError:
    return ValueError(f"{source}: the chat template cannot render {feature}: {error}. AxRL cannot follow this "
                      f"template: {advice} (check it with `axrl model check-template DIR`; docs/models.md lists "
                      "the conventions AxRL follows)")


def check_shapes(render: Render, source: str, template: str = "") -> Shapes:
    """Probe the Hugging Face message shapes AxRL sends; raise ValueError naming the first one a
    template that claims it cannot render (quoting the template's error, saying what to do).
    A template that raises on a system message gets it folded into the first user turn (Gemma's
    documented convention); one that writes no ``tool_calls`` at all is tool-free, not refused."""
    if (err := _try(render, [_USER], False)) is not None:
        raise _refuse(source, "a user message", err, "AxRL renders every prompt as chat messages")
    if (err := _try(render, [_USER, {"role": "assistant", "content": "a"}], False)) is not None:
        raise _refuse(source, "a user message followed by an assistant reply", err,
                      "the agent loop appends every reply to the conversation")
    fold = _try(render, [{"role": "system", "content": "s"}, _USER], False) is not None
    if (err := _try(render, [_USER], True)) is not None:
        raise _refuse(source, "a tools list (tools=[{type: function, function: {name, description, parameters}}])",
                      err, "tool-using tasks pass their schemas this way; render them (or ignore them) without raising")
    form, err = arguments_form(render)
    writes_calls = "tool_calls" in template
    if form is None:
        if writes_calls:
            raise _refuse(source, "an assistant tool call in the Hugging Face form (tool_calls=[{type: function, id, "
                          "function: {name, arguments}}], read as tool_call.function.name, arguments as a JSON "
                          "string or a mapping)", err, "read the call as tool_call.function (transformers' "
                          "convention); a template written for flat {name, arguments} calls needs that one change")
        return Shapes(None, fold, f"the template renders no tool calls ({err})")
    call = [_USER, {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]}, hf_tool_result("r", 1)]
    if (err := _try(render, call, True)) is not None:
        if writes_calls:
            raise _refuse(source, "a tool result (role 'tool' with tool_call_id, after the call)", err,
                          "tool results come back as role 'tool' messages; render them (Llama: as ipython turns, "
                          "Gemma: as user turns) instead of raising")
        return Shapes(None, fold, f"the template renders no tool results ({err})")
    return Shapes(form, fold)


def turn_end_at(text: str, start: int, ends: str | tuple[str, ...]) -> tuple[int, str]:
    """Where the turn that starts at ``start`` ends: the last occurrence of the first of
    ``ends`` (the turn end first, then the other stop tokens) found after ``start``; (-1, "")
    when none is."""
    for end in (ends,) if isinstance(ends, str) else ends:
        if end and (at := text.rfind(end)) >= start:
            return at, end
    return -1, ""


def whole_markers(prefix: str) -> str:
    """``prefix`` without a marker it cuts in two: where the generation prompt opens a block that
    a call's turn does not (R1's ``<think>\n``), the shared text may end inside ``<｜…｜>``."""
    cut = prefix.rfind("<")
    return prefix[:cut] if cut > prefix.rfind(">") else prefix


def call_body(render: Render, form: str, eos_token: str | tuple[str, ...], implicit: bool = False) -> str | None:
    """The text a template writes for one probe call after the reply's opening, an empty
    ``<think></think>`` block it puts in front (Qwen3 does, in the last turn) left out.
    ``eos_token``: the turn end, or every token that may end a turn — gpt-oss ends a call's turn
    with ``<|call|>``, not with the ``<|return|>`` of a final answer."""
    messages = [_USER, {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]}]
    tools = [PROBE_TOOL]  # calls come with tools (and Hermes-3's `tool_use` template renders them)
    text, before = render(messages, tools=tools), render(messages[:1], tools=tools, add_generation_prompt=True)
    opening = whole_markers(os.path.commonprefix([text, before]))
    stop, _ = turn_end_at(text, len(opening), eos_token)
    stop = len(text) if stop < 0 and implicit else stop  # nothing closes the turn (GLM-4.5)
    if not before.startswith(opening) or stop < 0:
        return None
    body = text[len(opening):stop]
    return re.sub(r"^\s*<think>\s*</think>\s*", "", body)


def tool_call_format(render: Render, form: str, eos_token: str | tuple[str, ...],
                     implicit: bool = False) -> ToolCallFormat | None:
    """How the template writes a tool call (see :class:`ToolCallFormat`), from its rendering of
    one probe call; None when it writes none that AxRL can read (e.g. it drops ``tool_calls``)."""
    body = call_body(render, form, eos_token, implicit)
    if body is None:
        return None
    messages = [_USER, {"role": "assistant", "content": "", "tool_calls": [probe_call(form)]}]
    tools = [PROBE_TOOL]
    before = os.path.commonprefix([render(messages, tools=tools),
                                   render(messages[:1], tools=tools, add_generation_prompt=True)])
    for pos in (i for i, ch in enumerate(body) if ch in "[{"):
        found = _json_at(body, pos)
        if found is None:
            continue
        value, stop = found
        first = value[0] if isinstance(value, list) and value else value
        if isinstance(first, dict) and first.get("name") == "probe":  # {"name", "arguments"} JSON
            return ToolCallFormat(body[:pos].strip(), body[stop:].strip())
        if value == PROBE_ARGS and "probe" in body[:pos]:  # the name before its arguments (DeepSeek)
            at = body.rindex("probe", 0, pos)
            try:
                start, end = _per_call(render, messages, before, eos_token, body[:at], body[stop:])
            except Exception:  # the template allows one call per turn (Llama 3.1): the list is the call
                start, end = body[:at], body[stop:]
            return ToolCallFormat(start.strip(), end.strip(), name_sep=body[at + len("probe"):pos])
    return None


def _per_call(render: Render, messages: list[Message], before: str, eos_token: str | tuple[str, ...], opening: str,
              closing: str) -> tuple[str, str]:
    """The text around *each* call when the template also wraps the whole list (DeepSeek's
    <｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>): a two-call rendering shows what sits between
    two calls, which is one call's close followed by the next one's opening."""
    call = messages[1]["tool_calls"][0]
    two = [messages[0], {**messages[1], "tool_calls": [call, {**call, "id": call_id(2)}]}]
    body = render(two, tools=[PROBE_TOOL])[len(before):]
    first = body.find('{"x": 1}')
    between = body[first + len('{"x": 1}'):body.find("probe", first)] if first >= 0 else ""
    fits = [k for k in range(len(between), -1, -1) if closing.startswith(between[:k]) and opening.endswith(between[k:])]
    # Split between two markers (`…end｜><｜begin…`), not inside one that merely shares letters.
    tidy = [k for k in fits if k in (0, len(between)) or between[k] in "<[" or between[k - 1] == "\n"]
    k = (tidy or fits or [None])[0]
    return (opening, closing) if k is None else (between[k:], between[:k])
