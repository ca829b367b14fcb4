"""The calculator agent built with the OpenAI Agents SDK (`openai-agents`): a framework-built
agent, trained by AxRL unchanged. Nothing of AxRL is imported; the Agents SDK is configured the
way it is for any OpenAI-compatible provider (a client from OPENAI_BASE_URL / OPENAI_API_KEY,
the Chat Completions API, tracing off since there is no OpenAI platform behind the URL).

    pip install openai-agents
    axrl train examples/blackbox.yaml --set 'agent.command=[python, examples/agents/calculator_agents_sdk.py]'
"""

from __future__ import annotations

import ast
import operator
import os
import sys
from fractions import Fraction

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

SYSTEM = "Use the calculator tool, then reply: The answer is N."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: + - * / // % and parentheses.

    Args:
        expression: e.g. 37 + 58
    """
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


def main() -> None:
    set_tracing_disabled(True)
    question = sys.stdin.read().strip() or " ".join(sys.argv[1:])
    model = OpenAIChatCompletionsModel(model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
                                       openai_client=AsyncOpenAI())
    agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculator], model=model,
                  model_settings=ModelSettings(max_tokens=64))
    result = Runner.run_sync(agent, question, max_turns=3)
    print(result.final_output)


if __name__ == "__main__":
    main()
