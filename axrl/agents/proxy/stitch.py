"""How a chat call is stitched onto the tokens a session already holds, and how its prompt drifts.

A black-box agent re-sends its whole conversation on every call. The proxy keeps what it already
has as tokens (an earlier prompt and the ids the model generated) and renders only the messages the
agent appended. "Only the appended messages" needs care: a template may render the *earlier*
messages differently once more messages follow (Qwen3 keeps ``<think>…</think>`` in the assistant
turns after the last user message only), so the rendering of the whole conversation does not start
with the rendering of its prefix. :func:`appended_text` finds the appended part anyway.

The stitched prompt then differs from what the template would render for the same conversation
(the reasoning the template drops is still in the stream; a reply the model spelled in
non-canonical tokens re-encodes differently): that difference is the *drift*, found by
:func:`drift_spans` and recorded, never "fixed" — the stream holds what the model conditioned on.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Sequence

from axrl.agents.env import Message
from axrl.core.token_stream import ChatRenderer

# Fields of an assistant message that carry what a template may drop from earlier turns.
_REASONING_FIELDS = ("reasoning_content", "reasoning")
_NEUTRAL = "."  # stands for an assistant reply's text while locating the appended messages


def render(tokenizer: ChatRenderer, messages: list[Message], tools: list[dict[str, Any]] | None, *,
           generation: bool) -> str:
    """The chat template's text for ``messages`` (with the assistant opening when ``generation``)."""
    return str(tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                             tokenize=False))


def _neutral(message: Message) -> Message:
    """``message`` with an assistant reply's text (and reasoning) replaced by a fixed stand-in, so
    that nothing a template renders conditionally on a reply's text (``</think>`` in it) remains."""
    if message.get("role") != "assistant":
        return message
    out = {k: v for k, v in message.items() if k not in _REASONING_FIELDS}
    out["content"] = _NEUTRAL
    return out


def appended_text(tokenizer: ChatRenderer, messages: list[Message], k: int, tools: list[dict[str, Any]] | None,
                  full: str) -> str | None:
    """The template's rendering of ``messages[k:]`` and the assistant opening, as it follows
    ``messages[:k]`` in ``full`` (the rendering of all of ``messages`` with the opening); None when
    the template renders the appended messages differently depending on what precedes them.

    First the plain way: ``full`` minus the rendering of ``messages[:k]``. When the template
    re-renders earlier messages once more follow, the same subtraction is done with every
    assistant reply of the prefix replaced by a stand-in: what the template does to the earlier
    replies is then identical on both sides and cancels, and the appended messages render as in
    ``full``.
    """
    base = render(tokenizer, messages[:k], tools, generation=False)
    if full.startswith(base):
        return full[len(base):]
    neutral = [_neutral(m) for m in messages[:k]]
    base = render(tokenizer, neutral, tools, generation=False)
    whole = render(tokenizer, neutral + list(messages[k:]), tools, generation=True)
    if not whole.startswith(base):
        return None
    appended = whole[len(base):]
    # The appended messages must be the tail of the real rendering too (they are unless the
    # template renders a message depending on the text of an earlier reply).
    return appended if full.endswith(appended) else None


@dataclass(frozen=True)
class Drift:
    """Where a stitched prompt differs from the template's rendering of the same conversation."""

    spans: tuple[tuple[int, int], ...] = ()  # [start, end) token positions in the stitched prompt
    tokens: int = 0                          # differing tokens: per span, the longer of the two sides

    def __bool__(self) -> bool:
        return self.tokens > 0


def drift_spans(stream: Sequence[int], rendered: Sequence[int]) -> Drift:
    """The spans of ``stream`` that differ from ``rendered`` (a token diff).

    Tokens ``rendered`` has and ``stream`` lacks (an insertion) mark the ``stream`` token at the
    insertion point, so that every drift has a position and a turn in the sample.
    """
    stream, rendered = list(stream), list(rendered)
    if stream == rendered:
        return Drift()
    # The common head and tail are most of a long prompt: diff only the middle (the diff is
    # quadratic in the worst case).
    head = 0
    while head < min(len(stream), len(rendered)) and stream[head] == rendered[head]:
        head += 1
    tail = 0
    while (tail < min(len(stream), len(rendered)) - head
           and stream[len(stream) - 1 - tail] == rendered[len(rendered) - 1 - tail]):
        tail += 1
    a, b = stream[head:len(stream) - tail], rendered[head:len(rendered) - tail]
    spans: list[tuple[int, int]] = []
    tokens = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        tokens += max(i2 - i1, j2 - j1)
        start, end = head + i1, head + i2
        if start == end:  # an insertion: mark the token it goes before (or the last one)
            start, end = (start, start + 1) if start < len(stream) else (start - 1, start)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return Drift(tuple(spans), tokens)
