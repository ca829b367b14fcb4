"""Gemma 4's tool calls and reasoning (vLLM's ``gemma4`` tool-call and reasoning parsers).

A call is ``<|tool_call>call:NAME{key:VALUE,…}<tool_call|>``, several calls back to back. Its
arguments are not JSON: keys are bare (or ``<|"|>``-quoted in nested mappings), strings are
delimited by the ``<|"|>`` token, numbers and booleans are written bare, mappings and lists nest
as ``{…}`` / ``[…]``. The values are read with a scanner, not a regular expression, so a string
holding ``}``, ``,`` or ``<tool_call|>`` stays one value.

Reasoning is a ``<|channel>thought\\n…<channel|>`` block opening the reply (the ``thought`` label
is not reasoning); a call that starts while the block is still open ends it, as vLLM reads it.
"""

from __future__ import annotations

import json
from typing import Any

from axrl.tokenizer.tool_calls import _entry

CALL_START, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CHANNEL_START, CHANNEL_END, THOUGHT = "<|channel>", "<channel|>", "thought"
_BARE_END = ",}]"
_NOT_IN_KEY = "{}[],<>\n"   # a bare key is a name: these mean the arguments are malformed


class _Malformed(ValueError):
    """A call's arguments that do not follow Gemma 4's format."""


def _value(text: str, pos: int) -> tuple[Any, int]:
    """The value at ``pos`` and the position after it."""
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Malformed(f"unterminated {QUOTE} string")
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _mapping(text, pos)
    if text.startswith("[", pos):
        items, pos = [], pos + 1
        while not text.startswith("]", pos):
            item, pos = _value(text, pos)
            items.append(item)
            if text.startswith(",", pos):
                pos += 1
            elif not text.startswith("]", pos):
                raise _Malformed(f"expected ',' or ']' at {pos}")
        return items, pos + 1
    end = pos
    while end < len(text) and text[end] not in _BARE_END:
        end += 1
    bare = text[pos:end].strip()
    if not bare:
        raise _Malformed(f"missing value at {pos}")
    try:
        return json.loads(bare), end   # numbers, true, false, null
    except json.JSONDecodeError:
        return bare, end


def _mapping(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """The ``{key:value,…}`` mapping opening at ``pos`` and the position after it."""
    out: dict[str, Any] = {}
    pos += 1
    while not text.startswith("}", pos):
        if text.startswith(QUOTE, pos):
            key, pos = _value(text, pos)
        else:
            colon = text.find(":", pos)
            if colon < 0:
                raise _Malformed(f"expected 'key:' at {pos}")
            key, pos = text[pos:colon].strip(), colon
        if not text.startswith(":", pos) or not key or any(c in str(key) for c in _NOT_IN_KEY):
            raise _Malformed(f"expected 'key:' at {pos}")
        out[str(key)], pos = _value(text, pos + 1)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("}", pos):
            raise _Malformed(f"expected ',' or '}}' at {pos}" if pos < len(text) else "unterminated arguments")
    return out, pos + 1


def parse_gemma4_calls(text: str) -> list[dict[str, Any]]:
    """Every ``<|tool_call>call:NAME{…}<tool_call|>`` of ``text``, in order; a call that cannot be
    read is an entry with ``error`` set (never raises)."""
    calls: list[dict[str, Any]] = []
    pos = 0
    while (at := text.find(CALL_START, pos)) >= 0:
        head = at + len(CALL_START)
        brace = text.find("{", head)
        stop = text.find(CALL_END, head)
        name = text[head:brace].strip().removeprefix("call:").strip() if brace >= 0 else ""
        if brace < 0 or (0 <= stop < brace) or not text[head:brace].strip().startswith("call:"):
            end = stop if stop >= 0 else len(text)
            calls.append(_entry(text[head:end], error=f"expected call:NAME{{…}} after {CALL_START}"))
            pos = end + len(CALL_END) if stop >= 0 else len(text)
            continue
        try:
            args, after = _mapping(text, brace)
            if not text.startswith(CALL_END, after):
                raise _Malformed(f"expected {CALL_END} after the arguments")
        except _Malformed as e:
            end = stop if stop >= 0 else len(text)
            calls.append(_entry(text[head:end], name=name or None, error=f"malformed Gemma 4 call: {e}"))
            pos = end + len(CALL_END) if stop >= 0 else len(text)
            continue
        raw = text[head:after]
        calls.append(_entry(raw, name=name, arguments=args) if name else _entry(raw, error="tool call without a name"))
        pos = after + len(CALL_END)
    return calls


def split_gemma4(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a Gemma 4 reply: the ``<|channel>thought\\n…<channel|>`` block that
    opens it, without its label; unclosed, it runs to the first call or the end."""
    start = text.find(CHANNEL_START)
    if start < 0 or text[:start].strip():
        return "", text
    body = start + len(CHANNEL_START)
    stop = text.find(CHANNEL_END, body)
    if stop < 0:
        stop = text.find(CALL_START, body)
        inner, rest = (text[body:], "") if stop < 0 else (text[body:stop], text[stop:])
    else:
        inner, rest = text[body:stop], text[stop + len(CHANNEL_END):]
    inner = inner.lstrip()
    if inner.startswith(THOUGHT):
        inner = inner[len(THOUGHT):]
    return inner.strip(), text[:start] + rest.lstrip("\n")
