"""Multi-turn tool use: answer "What is 37 + 58?" by calling a calculator tool first.

Ideal episode (see :func:`demonstration`)::

    user       What is 37 + 58?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58"}}</tool_call>
    tool       95
    assistant  The answer is 95.

Rewards (the episode reward is the final step's; tool steps give 0 unless ``turn_reward``):

* 1.0   correct final answer after at least one successful calculator call;
* ``no_tool_reward`` (default 0.1)   correct answer without a successful call (right, but the
  skill being taught is tool use);
* 0.0   wrong or missing answer, or more than ``max_tool_calls`` calls (the env then ends the
  episode without executing the extra call).

Partial credit per turn (``turn_reward``, default 0: off): the tool turn holding the episode's first
successful call (well-formed, and its expression evaluates) is rewarded ``turn_reward`` on that
turn, once per episode — a per-turn signal for ``algo.credit: turn`` (docs/algorithms.md). The
episode reward is then the sum of its step rewards.

A turn containing any ``<tool_call>`` block is a tool turn: every call is executed in order
and answered by one tool message. Malformed calls (bad JSON, unknown tool, missing
expression, an expression the calculator rejects) are answered with an ``Error: …`` tool
message, never an exception, and count towards ``max_tool_calls``. A turn without tool calls
is the final answer (parsed by :func:`axrl.agents.tasks.common.parse_answer`).
"""

from __future__ import annotations

import ast
import operator
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import (
    OPERATORS, Task, check_operands, expected_answer, format_number, make_config, parse_answer,
    sample_problem,
)
from axrl.tokenizer import parse_tool_calls
from axrl.tokenizer.tool_calls import hf_tool_call, hf_tool_result

NAME = "calculator"
SYSTEM_PROMPT = "Use the calculator tool, then reply: The answer is N."
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly: + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 + 58"}},
            "required": ["expression"],
        },
    },
}

# ---------------------------------------------------------------------------- safe evaluation

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_RESULT_BITS = 256  # bounds the work and the size of any intermediate value
# CPython before 3.11.8 keeps ast.parse's recursion counter in state shared by threads (gh-106905):
# agents calling the tool from several threads at once could get a spurious SystemError.
_PARSE_LOCK = threading.Lock()

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Symbols people (and models) write for the Python operators the parser understands.
_ALIASES = {"×": "*", "·": "*", "÷": "/", "−": "-", "^": "**"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (message is shown to the model)."""


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly, without ``eval``.

    The expression is parsed with :mod:`ast` and only number literals, ``+ - * / // % **``,
    unary signs and parentheses are interpreted; anything else (names, calls, attributes,
    subscripts, …) is rejected, so ``__import__('os')`` is just an unsupported expression.
    Arithmetic is on fractions, hence exact. Raises :class:`CalculatorError`.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for alias, op in _ALIASES.items():
        expression = expression.replace(alias, op)
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid expression: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is not a number here
        return Fraction(str(node.value))  # str(): 0.1 means one tenth, not the nearest double
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1:
                raise CalculatorError("only integer exponents are supported")
            if abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        result = Fraction(_BINARY[type(node.op)](left, right))
        if max(abs(result.numerator).bit_length(), result.denominator.bit_length()) > MAX_RESULT_BITS:
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"unsupported expression element: {type(node).__name__}")


# ---------------------------------------------------------------------------- task


@dataclass(frozen=True)
class CalculatorConfig:
    """Options of the calculator task (``get_task("calculator", **options)``)."""

    min_operand: int = 10
    max_operand: int = 99
    ops: tuple[str, ...] = ("+", "-", "*")
    max_tool_calls: int = 3
    no_tool_reward: float = 0.1
    turn_reward: float = 0.0  # partial credit on the turn of the first successful call (0: off)
    # The JSON tool schema costs ~400 prompt tokens; a tiny model taught the call format by
    # warm-up does not need it, and a 5x shorter prompt makes CPU runs 3-4x faster.
    show_tool_schema: bool = True


class CalculatorEnv:
    """The calculator tool-use env; see the module docstring for the protocol and rewards."""

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        self.config = config or CalculatorConfig()
        self.tools = [CALCULATOR_TOOL] if self.config.show_tool_schema else []
        self._answer: Fraction | None = None
        self._calls = 0
        self._used_tool = False

    def reset(self, prompt: Prompt) -> list[Message]:
        """Opening messages: a short system instruction (unless the prompt brings its own) and the question."""
        self._answer = expected_answer(prompt)
        self._calls, self._used_tool = 0, False
        messages = prompt.as_messages()
        if messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        return messages

    def step(self, action: str) -> StepOutcome:
        """Run the turn's tool calls, or score it as the final answer."""
        if self._answer is None:
            raise RuntimeError("step() before reset()")
        calls = parse_tool_calls(action)
        if calls:
            observation = []
            used_before = self._used_tool
            for call in calls:
                self._calls += 1
                if self._calls > self.config.max_tool_calls:
                    return StepOutcome([], 0.0, True, {"reason": "too_many_tool_calls", "tool_calls": self._calls})
                observation.append(hf_tool_result(self._run(call), self._calls))
            # Partial credit once per episode, on the turn whose call first succeeded.
            reward = self.config.turn_reward if self._used_tool and not used_before else 0.0
            return StepOutcome(observation, reward, False, {"tool_calls": self._calls})
        answer = parse_answer(action)
        correct = answer is not None and answer == self._answer
        reward = (1.0 if self._used_tool else self.config.no_tool_reward) if correct else 0.0
        return StepOutcome([], reward, True, {"answer": None if answer is None else format_number(answer),
                                              "correct": correct, "used_tool": self._used_tool,
                                              "tool_calls": self._calls})

    def _run(self, call: dict[str, Any]) -> str:
        """The tool message text for one parsed call (errors are answers, not exceptions)."""
        if call["error"]:
            return f"Error: {call['error']}"
        if call["name"] != "calculator":
            return f"Error: unknown tool {call['name']!r}; available tools: ['calculator']"
        expression = call["arguments"].get("expression")
        if not isinstance(expression, str):
            return 'Error: argument "expression" (a string) is required'
        try:
            value = evaluate(expression)
        except CalculatorError as exc:
            return f"Error: {exc}"
        self._used_tool = True
        return format_number(value)


def make_prompt(seed: int, index: int, config: CalculatorConfig) -> Prompt:
    """Problem ``index`` of stream ``seed``: "What is a op b?" with the exact answer in ``fields``."""
    a, op, b = sample_problem(seed, index, config.min_operand, config.max_operand, config.ops)
    expression = f"{a} {op} {b}"
    return Prompt(prompt_id=f"{NAME}-{seed}-{index}", text=f"What is {expression}?",
                  fields={"expression": expression, "answer": OPERATORS[op](a, b)})


def demonstration(prompt: Prompt, config: CalculatorConfig | None = None) -> list[Message]:
    """The ideal conversation: one calculator call with the question's expression, then the answer."""
    messages = CalculatorEnv(config).reset(prompt)
    expression = prompt.fields.get("expression")
    if not expression:  # file prompts may carry only the answer: compute it from the answer itself
        expression = format_number(expected_answer(prompt))
    result = format_number(evaluate(expression))
    return messages + [
        {"role": "assistant", "content": "",
         "tool_calls": [hf_tool_call("calculator", {"expression": expression}, 1)]},
        hf_tool_result(result, 1),
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def make_task(**options: Any) -> Task:
    """The calculator task; options are :class:`CalculatorConfig` fields."""
    config = make_config(CalculatorConfig, NAME, options)
    check_operands(NAME, config.min_operand, config.max_operand, tuple(config.ops))
    if config.max_tool_calls < 1:
        raise ValueError(f"task {NAME!r}: max_tool_calls must be >= 1, got {config.max_tool_calls}")
    return Task(
        name=NAME,
        make_env=lambda: CalculatorEnv(config),
        prompt=lambda seed, index: make_prompt(seed, index, config),
        demonstration=lambda prompt: demonstration(prompt, config),
        description="multi-turn tool use: call the calculator, then state the answer",
    )
