"""Single-turn arithmetic with a verifiable reward: "Compute 4 + 7." → "The answer is 11."

Reward 1.0 when the parsed answer (:func:`axrl.agents.tasks.common.parse_answer`: the last
"answer is N", else the last number in the reply) equals the exact result, else 0.0. The
episode always ends after the one reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import (
    OPERATORS, Task, check_operands, expected_answer, format_number, make_config, parse_answer,
    sample_problem,
)

NAME = "arithmetic"


@dataclass(frozen=True)
class ArithmeticConfig:
    """Options of the arithmetic task (``get_task("arithmetic", **options)``)."""

    min_operand: int = 0
    max_operand: int = 9
    ops: tuple[str, ...] = ("+", "-", "*")


class ArithmeticEnv:
    """One question, one answer, reward 1.0 if the answer is right."""

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        self._answer: Fraction | None = None

    def reset(self, prompt: Prompt) -> list[Message]:
        """The prompt's messages as they are (no system message: the shortest useful context)."""
        self._answer = expected_answer(prompt)
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        """Score the reply and end the episode."""
        if self._answer is None:
            raise RuntimeError("step() before reset()")
        answer = parse_answer(action)
        correct = answer is not None and answer == self._answer
        return StepOutcome([], 1.0 if correct else 0.0, True,
                           {"answer": None if answer is None else format_number(answer), "correct": correct})


def make_prompt(seed: int, index: int, config: ArithmeticConfig) -> Prompt:
    """Problem ``index`` of stream ``seed``: "Compute a op b." with the exact answer in ``fields``."""
    a, op, b = sample_problem(seed, index, config.min_operand, config.max_operand, config.ops)
    expression = f"{a} {op} {b}"
    return Prompt(prompt_id=f"{NAME}-{seed}-{index}", text=f"Compute {expression}.",
                  fields={"expression": expression, "answer": OPERATORS[op](a, b)})


def demonstration(prompt: Prompt) -> list[Message]:
    """The ideal conversation: the question and "The answer is N."."""
    answer = format_number(expected_answer(prompt))
    return ArithmeticEnv().reset(prompt) + [{"role": "assistant", "content": f"The answer is {answer}."}]


def make_task(**options: Any) -> Task:
    """The arithmetic task; options are :class:`ArithmeticConfig` fields."""
    config = make_config(ArithmeticConfig, NAME, options)
    check_operands(NAME, config.min_operand, config.max_operand, tuple(config.ops))
    return Task(
        name=NAME,
        make_env=ArithmeticEnv,
        prompt=lambda seed, index: make_prompt(seed, index, config),
        demonstration=demonstration,
        description="single turn: compute a small expression, reward 1 if right",
    )
