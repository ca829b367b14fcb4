"""Response shapes of the OpenAI endpoints: the envelope, choices, finish reasons, tool calls,
usage. Both front-ends build their non-streamed replies and their streamed chunks from these."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from axrl.tokenizer import Tokenizer
from axrl.tokenizer.reasoning import THINK_END, THINK_START


@dataclasses.dataclass
class Envelope:
    """What every reply (or chunk) of one call carries: its id, creation time and model."""

    chat: bool
    model: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def head(self, stream: bool = False) -> dict[str, Any]:
        """`id`, `object`, `created`, `model` of a reply (`stream`: of its chunks)."""
        if self.chat:
            prefix, obj = "chatcmpl", "chat.completion.chunk" if stream else "chat.completion"
        else:
            prefix, obj = "cmpl", "text_completion"
        return {"id": f"{prefix}-{self.id}", "object": obj, "created": self.created, "model": self.model}

    def reply(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed reply."""
        return {**self.head(), "choices": choices, "usage": usage}


def reply_text(tokenizer: Tokenizer | None, ids: list[int], *, chat: bool, skip_special: bool) -> str:
    """The reply text of output ids: chat keeps tool-call tags and drops the end-of-turn token."""
    if tokenizer is None:
        return ""
    if chat and ids and ids[-1] in tokenizer.stop_token_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=skip_special)


def tool_calls_of(tokenizer: Tokenizer | None, tools: Any, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls, OpenAI tool_calls) of a chat reply; no calls without `tools`."""
    if not tools or tokenizer is None:
        return text, []
    good = [c for c in tokenizer.parse_tool_calls(text, tools) if c["error"] is None]
    if not good:
        return text, []
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in good]
    start = tokenizer.tool_call_start  # "" for bare JSON / pythonic calls: the reply is the calls
    return (text.split(start)[0].strip() if start else "") or None, calls


def reasoning_of(tokenizer: Tokenizer | None, text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a chat reply by the family's reasoning parser (`<think>` blocks,
    harmony's analysis channel): what vLLM and SGLang return as `message.reasoning_content`. The
    reasoning is None for a family without a reasoning parser and for a reply without reasoning."""
    if tokenizer is None or tokenizer.reasoning_parser is None:
        return None, text
    reasoning, rest = tokenizer.split_reasoning(text)
    return reasoning or None, rest


def streamed_reasoning(tokenizer: Tokenizer, text: str) -> tuple[str, str] | None:
    """(reasoning, content) of a running reply that may be streamed now, each a prefix of what the
    finished reply splits into; None where the family has no reasoning parser. A `<think>` tag
    still being written is held back (the part sent never changes); a harmony reply is held back
    whole until it ends (its channels are only known at their end)."""
    parser = tokenizer.reasoning_parser
    if parser is None:
        return None
    if parser != "think":
        return "", ""
    head = text.lstrip()
    if not tokenizer.reasoning_opened and head and len(head) < len(THINK_START) and THINK_START.startswith(head):
        return "", ""  # "<thi": the block may be opening
    if THINK_END not in text:  # inside the block (or none): hold back a half-written "</think>"
        text = text[:len(text) - next((n for n in range(len(THINK_END) - 1, 0, -1)
                                       if text.endswith(THINK_END[:n])), 0)]
    reasoning, rest = tokenizer.split_reasoning(text)
    return reasoning, rest


def tool_call_start(tokenizer: Tokenizer) -> str | None:
    """The text that opens a tool call in the template's replies (what a stream holds back from);
    None where calls have no opening marker (bare JSON)."""
    return tokenizer.tool_call_start or None


def finish_reason(finish_type: str, *, tool_calls: bool, abort: str = "abort") -> str:
    """OpenAI's finish_reason of an engine finish ("stop" also after a stop-string cut): a stop
    with tool calls is "tool_calls"; an abort is `abort` (SGLang says "abort", OpenAI has none)."""
    if finish_type == "stop":
        return "tool_calls" if tool_calls else "stop"
    return "length" if finish_type == "length" else abort


def assistant_message(content: str | None, calls: list[dict[str, Any]], *, reasoning: str | None = None,
                      with_reasoning: bool = False) -> dict[str, Any]:
    """A chat reply's message (`tool_calls` only when there are some; `reasoning_content`, as vLLM
    and SGLang name it, when `with_reasoning`: the family has a reasoning parser)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if with_reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def chat_choice(index: int, message: dict[str, Any], finish: str) -> dict[str, Any]:
    """One choice of a chat reply."""
    return {"index": index, "message": message, "logprobs": None, "finish_reason": finish}


def completion_choice(index: int, text: str, finish: str) -> dict[str, Any]:
    """One choice of a completion reply."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens` (prompt tokens served from a prefix cache) when known."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out
