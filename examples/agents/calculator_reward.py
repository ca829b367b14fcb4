"""The verifier of examples/blackbox.yaml (`agent.verifier`): scores a finished agent session.

AxRL calls `score(prompt, messages)` on each root-to-leaf path of the session: `messages` is the
conversation the model saw (role, content, tool_calls [{name, arguments}]), ending with its last
reply; `prompt.fields["answer"]` is the calculator task's exact answer. Same rewards as the
white-box calculator task: 1.0 right after a successful tool call, 0.1 right without one, else 0.
"""

from __future__ import annotations

from typing import Any

from axrl.agents.env import Prompt
from axrl.agents.tasks.common import expected_answer, parse_answer


def score(prompt: Prompt, messages: list[dict[str, Any]]) -> float:
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0  # the agent stopped on a tool call (ran out of turns)
    answer = parse_answer(last.get("content") or "")
    if answer is None or answer != expected_answer(prompt):
        return 0.0
    used_tool = any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("Error")
                    for m in messages)
    return 1.0 if used_tool else 0.1
