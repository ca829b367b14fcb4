"""Parse ``<tool_call>`` blocks out of assistant-generated text.

The policy is a model being trained, so its output is routinely malformed. Parsing never
raises: each block yields one entry, and a bad block yields an entry with ``error`` set so
the environment can answer with an error message (and the reward can penalise it).
"""

from __future__ import annotations

import functools
import json
import re
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
    args = obj.get("arguments", {})
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
