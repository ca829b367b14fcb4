"""The black-box calculator agent over Anthropic's Messages API: the official `anthropic` SDK and
nothing of AxRL (the chat-completions version is calculator_agent.py; same tool, same prompt).

It reads a question on stdin, asks the model with a `calculator` tool, runs the `tool_use` blocks
itself, sends `tool_result` blocks back and prints the final answer. It is configured the way any
Anthropic client is: `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY` (and `ANTHROPIC_MODEL`) from the
environment — which AxRL sets to the episode's own proxy session (`…/sessions/{id}`).

    ANTHROPIC_MODEL=claude-haiku-4-5 python examples/agents/calculator_agent_anthropic.py <<< "What is 37 + 58?"

    axrl train examples/blackbox_anthropic.yaml        # the same file, unchanged, trained by AxRL
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from anthropic import Anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_agent import MAX_TURNS, SYSTEM, TOOLS, calculate  # noqa: E402 — the same tool and prompt

# Anthropic's tool definition of the same calculator: name, description, input_schema.
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def run(base_url: str | None, api_key: str | None, question: str, model: str | None = None) -> str:
    """Answer `question` with the model at `base_url` (None: the ANTHROPIC_* environment; an
    OpenAI-style …/v1 URL, as AxRL's `agent.function` gets, works too); the answer."""
    client = Anthropic(base_url=base_url.removesuffix("/v1") if base_url else None, api_key=api_key)
    model = model or os.environ.get("ANTHROPIC_MODEL", "claude-haiku-4-5")
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.messages.create(model=model, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS,
                                       max_tokens=64)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": calculate(str(b.input.get("expression", "")))}
            for b in uses]})
    return "(no answer)"


def main() -> None:
    question = sys.stdin.read().strip() or " ".join(sys.argv[1:])
    print(run(None, None, question))  # ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY from the environment


if __name__ == "__main__":
    main()
