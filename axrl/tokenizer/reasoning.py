"""Reasoning parsers: split a reply's reasoning from the rest, per family (vLLM's
``--reasoning-parser`` names).

* ``think`` (vLLM's ``qwen3`` / ``deepseek_r1`` / ``glm45`` / ``kimi``): a ``<think>…</think>``
  block. When the generation prompt already opened the block (DeepSeek-R1 distills end it with
  ``<think>\\n``) the reply starts inside it: everything up to the first ``</think>`` is reasoning.
* ``openai`` (gpt-oss harmony): the ``analysis`` channel's messages are reasoning; the ``final``
  channel is the content; ``commentary`` messages addressed to a function are tool calls and stay
  in the text for the tool parser.
* ``gemma4`` (Gemma 4): a ``<|channel>thought\n…<channel|>`` block opening the reply
  (:func:`axrl.tokenizer.gemma4_calls.split_gemma4`).

The split never raises: an unclosed block is reasoning up to the end of the reply (the model was
cut off while thinking), and a reply without reasoning is returned whole.
"""

from __future__ import annotations

import re

from axrl.tokenizer.gemma4_calls import CHANNEL_START, split_gemma4

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("think", "openai", "gemma4")
_HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>assistant)?((?:(?!<\|message\|>).)*?)<\|message\|>(.*?)"
                              r"(<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)


def split_think(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, rest) of a reply with ``<think>`` blocks; ``opened``: the prompt opened one."""
    if opened and THINK_START not in text.split(THINK_END, 1)[0]:
        if THINK_END not in text:
            return text.strip(), ""
        head, rest = text.split(THINK_END, 1)
        return head.strip(), rest.lstrip("\n")
    start = text.find(THINK_START)
    if start < 0 or text[:start].strip():
        return "", text  # reasoning is only the block that opens the reply
    stop = text.find(THINK_END, start)
    if stop < 0:
        return text[start + len(THINK_START):].strip(), ""
    return text[start + len(THINK_START):stop].strip(), text[:start] + text[stop + len(THINK_END):].lstrip("\n")


def split_harmony(text: str) -> tuple[str, str]:
    """(analysis text, the rest) of a harmony reply: the final channel's text, and each message
    addressed to a function kept whole for the tool parser."""
    reasoning: list[str] = []
    rest: list[str] = []
    for m in _HARMONY_MESSAGE.finditer(text):
        header, body = m.group(1), m.group(2)
        if "to=functions." in header:
            rest.append(m.group(0))
        elif "analysis" in header:
            reasoning.append(body.strip())
        else:
            rest.append(body)
    if not reasoning and not rest:
        return "", text
    return "\n".join(r for r in reasoning if r), "".join(rest)


def split_reasoning(text: str, parser: str | None, opened: bool = False) -> tuple[str, str]:
    """(reasoning, rest) of ``text`` with the named reasoning parser (None: no reasoning)."""
    if parser == "think":
        return split_think(text, opened)
    if parser == "openai":
        return split_harmony(text)
    if parser == "gemma4":
        return split_gemma4(text)
    return "", text


def detect_reasoning_parser(template: str, generation_prompt: str) -> str | None:
    """The reasoning parser a template implies: harmony channels, or ``<think>`` blocks."""
    if "<|channel|>" in template and "analysis" in template:
        return "openai"
    if CHANNEL_START in template:
        return "gemma4"
    if THINK_START in template or THINK_START in generation_prompt:
        return "think"
    return None
