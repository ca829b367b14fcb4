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
from typing import Any, Collection, Sequence

from axrl.agents.env import Message
from axrl.core.token_stream import ChatRenderer

# Fields of an assistant message that carry what a template may drop from earlier turns.
# transformers 5 reads a message's reasoning under all three names (axrl.tokenizer.chat_template).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
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


# Above this many cells (tokens × tokens) a piece is not diffed token by token: it is one span
# (difflib is quadratic in the worst case, and a prompt can be long and repetitive).
MAX_DIFF_CELLS = 1 << 20


def drift_spans(stream: Sequence[int], rendered: Sequence[int], anchors: Collection[int] = ()) -> Drift:
    """The spans of ``stream`` that differ from ``rendered`` (a token diff).

    ``anchors`` are ids that mark message boundaries (the special tokens: ``<|im_start|>``,
    ``<|im_end|>``): when both sides hold the same sequence of them, the pieces between them are
    diffed pairwise — a message's drift stays in its message and the cost stays that of the
    messages that differ. Tokens ``rendered`` has and ``stream`` lacks (an insertion) mark the
    ``stream`` token at the insertion point, so that every drift has a position and a turn.
    """
    stream, rendered = list(stream), list(rendered)
    if stream == rendered:
        return Drift()
    cuts_a = [i for i, t in enumerate(stream) if t in anchors]
    cuts_b = [i for i, t in enumerate(rendered) if t in anchors]
    if [stream[i] for i in cuts_a] == [rendered[i] for i in cuts_b]:
        bounds_a = list(zip([0] + [i + 1 for i in cuts_a], cuts_a + [len(stream)]))
        bounds_b = list(zip([0] + [i + 1 for i in cuts_b], cuts_b + [len(rendered)]))
    else:  # the message structure itself differs: one piece
        bounds_a, bounds_b = [(0, len(stream))], [(0, len(rendered))]
    spans: list[tuple[int, int]] = []
    tokens = 0
    for (a0, a1), (b0, b1) in zip(bounds_a, bounds_b):
        tokens += _diff_piece(stream, a0, a1, rendered, b0, b1, spans)
    return Drift(tuple(spans), tokens)


def _diff_piece(stream: list[int], a0: int, a1: int, rendered: list[int], b0: int, b1: int,
                spans: list[tuple[int, int]]) -> int:
    """Diff ``stream[a0:a1]`` against ``rendered[b0:b1]``: add the differing spans (positions in
    ``stream``) to ``spans``, return how many tokens differ."""
    # The common head and tail are most of a piece: only the middle is diffed.
    while a0 < a1 and b0 < b1 and stream[a0] == rendered[b0]:
        a0, b0 = a0 + 1, b0 + 1
    while a1 > a0 and b1 > b0 and stream[a1 - 1] == rendered[b1 - 1]:
        a1, b1 = a1 - 1, b1 - 1
    if a0 == a1 and b0 == b1:
        return 0
    if (a1 - a0) * (b1 - b0) > MAX_DIFF_CELLS or a0 == a1 or b0 == b1:
        ops = [(a0, a1, b0, b1)]
    else:
        matcher = difflib.SequenceMatcher(None, stream[a0:a1], rendered[b0:b1], autojunk=False)
        ops = [(a0 + i1, a0 + i2, b0 + j1, b0 + j2) for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal"]
    tokens = 0
    for i1, i2, j1, j2 in ops:
        tokens += max(i2 - i1, j2 - j1)
        if i1 == i2:  # an insertion: mark the token it goes before (or the last one)
            i1, i2 = (i1, i1 + 1) if i1 < len(stream) else (i1 - 1, i1)
        if spans and i1 <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(i2, spans[-1][1]))
        else:
            spans.append((i1, i2))
    return tokens
