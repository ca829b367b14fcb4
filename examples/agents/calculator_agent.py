"""A black-box calculator agent: the official OpenAI Python SDK and nothing of AxRL.

It reads a question on stdin ("What is 37 + 58?"), asks the model with a `calculator` function
tool, runs the tool calls itself, sends the results back as `tool` messages, and prints the final
answer. It is configured the way any OpenAI client is: `OPENAI_BASE_URL`, `OPENAI_API_KEY` (and
`OPENAI_MODEL`) from the environment — which AxRL sets to the episode's own proxy session.

    OPENAI_BASE_URL=https://api.openai.com/v1 OPENAI_MODEL=gpt-4o-mini \
        python examples/agents/calculator_agent.py <<< "What is 37 + 58?"

    axrl train examples/blackbox.yaml        # the same file, unchanged, trained by AxRL

`run(base_url, api_key, question)` is the same agent as a function (`agent.function:
examples/agents/calculator_agent.py:run` runs it in-process: no interpreter start per episode).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from fractions import Fraction

from openai import OpenAI

SYSTEM = "Use the calculator tool, then reply: The answer is N."
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string", "description": "e.g. 37 + 58"}}}}}]
MAX_TURNS = 3
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """The tool: exact arithmetic over + - * / // % (no eval); errors are answers."""
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def run(base_url: str | None, api_key: str | None, question: str, model: str | None = None) -> str:
    """Answer `question` with the model at `base_url` (None: the OPENAI_* environment); the answer."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = model or os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=64)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return str(message.content)
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return "(no answer)"


def main() -> None:
    question = sys.stdin.read().strip() or " ".join(sys.argv[1:])
    print(run(None, None, question))  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment


if __name__ == "__main__":
    main()
