"""The black-box calculator agent over OpenAI's Responses API (`client.responses.create`): the
official OpenAI SDK and nothing of AxRL (the chat-completions version is calculator_agent.py; same
tool, same prompt).

It reads a question on stdin, asks the model with a `calculator` function tool, runs the
`function_call` items itself, sends `function_call_output` items back (the whole conversation in
`input`: stateless, no previous_response_id) and prints the final answer. Configured by
`OPENAI_BASE_URL`, `OPENAI_API_KEY` (and `OPENAI_MODEL`), which AxRL sets to the episode's session.

    OPENAI_MODEL=gpt-4o-mini python examples/agents/calculator_agent_responses.py <<< "What is 37 + 58?"

    axrl train examples/blackbox_responses.yaml        # the same file, unchanged, trained by AxRL
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_agent import MAX_TURNS, SYSTEM, TOOLS, calculate  # noqa: E402 — the same tool and prompt

# The Responses API's function tool: the chat tool's fields, flattened.
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def run(base_url: str | None, api_key: str | None, question: str, model: str | None = None) -> str:
    """Answer `question` with the model at `base_url` (None: the OPENAI_* environment); the answer."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = model or os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
    items: list[dict] = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        response = client.responses.create(model=model, instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS,
                                           max_output_tokens=64, store=False)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:
            try:
                expression = json.loads(call.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": calculate(str(expression))})
    return "(no answer)"


def main() -> None:
    question = sys.stdin.read().strip() or " ".join(sys.argv[1:])
    print(run(None, None, question))  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment


if __name__ == "__main__":
    main()
