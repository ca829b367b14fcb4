"""The white-box environment protocol: what the agent loop needs from a task.

An :class:`Env` speaks chat messages, never tokens: ``reset`` gives the opening conversation,
``step`` takes the assistant's text for one turn and answers with the messages to append
(tool results, feedback) plus a reward. The agent loop owns tokenisation, so every env gets
the exact, prefix-stable token stream for free.

One env instance serves one episode at a time (``reset`` starts a new one); make one per
concurrent episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from axrl.tokenizer.tool_calls import TOOL_CALL_END, TOOL_CALL_START

if TYPE_CHECKING:
    from axrl.tokenizer import Tokenizer

Message = dict[str, Any]


@dataclass
class Prompt:
    """One task instance.

    Either ``messages`` (a chat) or ``text`` (a single user message) is set. ``fields`` holds
    the task data the env needs to score the episode (e.g. ``{"answer": 95}``); it is never
    shown to the model unless the env puts it into a message.
    """

    prompt_id: str
    messages: list[Message] | None = None
    text: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"prompt {self.prompt_id!r}: set exactly one of 'messages' and 'text'")

    def as_messages(self) -> list[Message]:
        """The prompt as chat messages (a ``text`` prompt becomes one user message); a copy."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text}]


@dataclass
class StepOutcome:
    """What the env answers to one assistant turn.

    ``observation`` is the messages to append before the next assistant turn (role "tool" for
    tool results, "user" for feedback); it is ignored when ``done`` (nothing would read it).
    ``reward`` is this step's reward; the episode's reward is the sum over steps.
    """

    observation: list[Message]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment.

    ``tools``: tool schemas (OpenAI function format) rendered into the system block by the
    chat template; empty for tool-free tasks.
    """

    tools: list[dict[str, Any]]

    def reset(self, prompt: Prompt) -> list[Message]:
        """Start an episode; return the opening messages (e.g. system + user)."""
        ...

    def step(self, action: str) -> StepOutcome:
        """Consume the assistant's text for one turn (tool calls included, as
        ``<tool_call>`` blocks whatever the chat template's own format — see `env_action` —,
        without the end-of-turn token)."""
        ...


def env_action(tokenizer: Tokenizer, text: str) -> str:
    """What ``Env.step`` receives for a reply the model wrote as ``text``: the reply itself when
    the chat template writes tool calls as ``<tool_call>`` blocks, else its tool calls rewritten
    into them (Llama's bare JSON, Mistral's ``[TOOL_CALLS]`` list, DeepSeek's name-outside
    form …), the prose before the first call kept. So an env parses one format, whatever the
    model's template; the trained tokens are the model's own and are not touched."""
    parser, fmt = tokenizer.tool_parser, tokenizer.tool_call_format
    if (parser.name == "hermes") if parser is not None else (fmt is None or fmt.tags == (TOOL_CALL_START, TOOL_CALL_END)):
        return text
    calls = tokenizer.parse_tool_calls(text)
    if not calls:
        return text
    start = tokenizer.tool_call_start
    at = text.find(start) if start else len(text) - len(text.lstrip())
    blocks = [c["raw"] if c.get("error") else json.dumps({"name": c["name"], "arguments": c["arguments"]})
              for c in calls]
    return text[:max(at, 0)] + "".join(f"{TOOL_CALL_START}{b}{TOOL_CALL_END}" for b in blocks)


def assistant_text(tokenizer: Tokenizer, message: Message) -> str:
    """The text the model generates for an assistant ``message`` (structured ``tool_calls``
    rendered the way the chat template writes them), i.e. what ``Env.step`` receives for it.

    Derived from the chat template so it stays right if the template changes.
    """
    return tokenizer.reply_text(message)


def replay_conversation(env: Env, prompt: Prompt, conversation: list[Message],
                        tokenizer: Tokenizer) -> float:
    """Drive ``env`` with the assistant turns of ``conversation``; return the summed reward.

    Checks that the conversation is one the env would produce: it must start with
    ``env.reset(prompt)`` and every non-assistant stretch must equal the env's observation.
    Used to validate demonstrations (supervised warm-up data) against the task's own scoring.
    Raises ValueError on a mismatch.
    """
    opening = env.reset(prompt)
    if conversation[:len(opening)] != opening:
        raise ValueError("conversation does not start with env.reset(prompt)")
    i, total = len(opening), 0.0
    while i < len(conversation):
        message = conversation[i]
        if message.get("role") != "assistant":
            raise ValueError(f"message {i}: expected an assistant turn, got role {message.get('role')!r}")
        outcome = env.step(env_action(tokenizer, assistant_text(tokenizer, message)))
        total += float(outcome.reward)
        i += 1
        if outcome.done:
            if i != len(conversation):
                raise ValueError(f"env ended the episode at message {i - 1}, "
                                 f"{len(conversation) - i} message(s) early")
            return total
        observed = conversation[i:i + len(outcome.observation)]
        if observed != outcome.observation:
            raise ValueError(f"messages {i}..: conversation has {observed!r}, env observed "
                             f"{outcome.observation!r}")
        i += len(outcome.observation)
    raise ValueError("conversation ended before the env finished the episode")
