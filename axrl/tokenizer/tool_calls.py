"""Parse tool calls out of assistant-generated text.

The policy is a model being trained, so its output is routinely malformed. Parsing never
raises: each block yields one entry, and a bad block yields an entry with ``error`` set so
the environment can answer with an error message (and the reward can penalise it).

Tagged blocks (``<tool_call>`` … ``</tool_call>``, Qwen / ChatML) are what
:func:`parse_tool_calls` reads; :func:`parse_with_format` reads the other shapes chat templates
write, described by a :class:`ToolCallFormat` read off the template (a start tag and a JSON list,
Mistral's ``[TOOL_CALLS]``; bare JSON, Llama 3.1; the name outside the JSON, DeepSeek-V3).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"



@functools.lru_cache(maxsize=8)
def _block(start: str, end: str) -> re.Pattern[str]:
    # A block runs to the next end tag; a start tag with no end (generation hit max_new_tokens or
    # stopped early) runs to the end of the text so it is reported instead of silently dropped.
    return re.compile(re.escape(start) + r"(.*?)(" + re.escape(end) + r"|$)", re.S)


def _entry(raw: str, name: str | None = None, arguments: dict[str, Any] | None = None,
           error: str | None = None) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "error": error, "raw": raw}


def _parse_one(raw: str, closed: bool, start: str) -> dict[str, Any]:
    if not closed:
        return _entry(raw, error=f"unterminated {start} block")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return _entry(raw, error=f"invalid JSON: {exc.msg} at position {exc.pos}")
    if not isinstance(obj, dict):
        return _entry(raw, error="tool call must be a JSON object")
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI-shaped call
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _entry(raw, error='tool call needs a non-empty string "name"')
    # Llama 3.1's JSON calls name the arguments "parameters".
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments serialised as a JSON string, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return _entry(raw, name=name, error=f"invalid JSON in arguments: {exc.msg}")
    if not isinstance(args, dict):
        return _entry(raw, name=name, error='"arguments" must be a JSON object')
    return _entry(raw, name=name, arguments=args)


def parse_tool_calls(text: str, start: str = TOOL_CALL_START, end: str = TOOL_CALL_END) -> list[dict[str, Any]]:
    """Extract the tool calls from assistant text, in order (blocks ``start`` … ``end``; a
    tokenizer's :meth:`~axrl.tokenizer.Tokenizer.parse_tool_calls` passes its template's tags).

    Each entry is ``{"name", "arguments", "error", "raw"}``: on success ``error`` is None,
    ``name`` is a str and ``arguments`` a dict; on failure ``error`` says why (``name`` is
    kept when it could be read). ``raw`` is the stripped text inside the tags. Text without
    any ``<tool_call>`` yields ``[]``. Decode with ``skip_special_tokens=False`` so the tags
    survive.
    """
    return [_parse_one(m.group(1).strip(), closed=bool(m.group(2)), start=start)
            for m in _block(start, end).finditer(text)]


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat template writes one tool call, read off its rendering of a probe call.

    ``start`` + JSON + ``end``, where the JSON is ``{"name", "arguments"}`` (or a list of such,
    after a start tag alone: Mistral). ``start`` "" means bare JSON (Llama 3.1); ``end`` "" means
    the JSON ends the call. With ``name_sep`` set the name is written outside the JSON, which then
    holds only the arguments: ``start`` + name + ``name_sep`` + arguments + ``end`` (DeepSeek-V3).
    """

    start: str
    end: str
    name_sep: str | None = None

    @property
    def tags(self) -> tuple[str, str] | None:
        """``(start, end)`` when the calls are tagged blocks that :func:`parse_tool_calls` reads."""
        return (self.start, self.end) if self.start and self.end and self.name_sep is None else None

    def describe(self) -> str:
        """One line for people: what a call looks like."""
        body = ('NAME' + self.name_sep + '{arguments}') if self.name_sep is not None \
            else '{"name": ..., "arguments": ...}'
        return repr(self.start + body + self.end) if self.start else f"bare JSON {body}"


_DECODER = json.JSONDecoder()


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and where it ends; None if none."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def _named(raw: str, name: str, args: Any) -> dict[str, Any]:
    return _parse_one(json.dumps({"name": name.strip(), "arguments": args}), True, "") | {"raw": raw}


def _parse_untagged(text: str, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Calls in a format that is not a pair of tags: scan for ``start``, read the JSON after it."""
    calls: list[dict[str, Any]] = []
    pos = 0 if fmt.start else len(text) - len(text.lstrip())
    if not fmt.start and not text[pos:pos + 1] in ("{", "["):
        return []  # bare JSON must open the reply: prose that merely contains braces is no call
    while True:
        at = text.find(fmt.start, pos) if fmt.start else pos
        if at < 0:
            return calls
        begin = at + len(fmt.start)
        name = None
        if fmt.name_sep is not None:
            sep = text.find(fmt.name_sep, begin)
            if sep < 0:
                return calls + [_entry(text[begin:].strip(), error=f"no {fmt.name_sep!r} after the tool name")]
            name, begin = text[begin:sep], sep + len(fmt.name_sep)
        value = _json_at(text, begin)
        if value is None:
            return calls + [_entry(text[begin:].strip(), name=name, error="invalid JSON after the tool call start")]
        obj, stop = value
        raw = text[begin:stop].strip()
        items = obj if isinstance(obj, list) and name is None else [obj]
        calls += [_named(raw, name, obj) if name is not None else _parse_one(json.dumps(o), True, "") | {"raw": raw}
                  for o in items]
        pos = stop
        if fmt.end:
            rest = text[stop:].lstrip()
            if not rest.startswith(fmt.end):
                calls[-1] = calls[-1] | {"error": f"unterminated tool call (no {fmt.end!r})"}
                return calls
            pos = len(text) - len(rest) + len(fmt.end)
        if not fmt.start and not text[pos:].lstrip().startswith("{"):
            return calls  # bare JSON: calls follow one another, nothing else may come between
        if not fmt.start:
            pos = len(text) - len(text[pos:].lstrip())


def parse_with_format(text: str, fmt: ToolCallFormat | None) -> list[dict[str, Any]]:
    """The tool calls in ``text`` written the way ``fmt`` says (None: ``<tool_call>`` blocks);
    entries as :func:`parse_tool_calls` returns them."""
    if fmt is None:
        return parse_tool_calls(text)
    if fmt.tags:
        return parse_tool_calls(text, start=fmt.start, end=fmt.end)
    return _parse_untagged(text, fmt)


def call_id(index: int) -> str:
    """The id of an episode's ``index``-th tool call (1-based). Nine alphanumerics: Mistral's
    templates refuse other lengths, and the model never sees ids in the tagged formats."""
    return f"call{index:05d}"


def hf_tool_call(name: str, arguments: dict[str, Any] | str, index: int) -> dict[str, Any]:
    """A tool call in the Hugging Face / OpenAI form chat templates read
    (``tool_call.function.name``), for an assistant message's ``tool_calls``."""
    return {"type": "function", "id": call_id(index), "function": {"name": name, "arguments": arguments}}


def hf_tool_result(content: str, index: int) -> dict[str, Any]:
    """The ``tool`` message answering the episode's ``index``-th call."""
    return {"role": "tool", "tool_call_id": call_id(index), "content": content}
