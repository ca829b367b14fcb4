"""Pieces shared by the built-in tasks: the task record, seeded problem sampling, answer parsing."""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from axrl.agents.env import Env, Message, Prompt

# The operators problems are drawn from, by the symbol shown to the model (ASCII on purpose:
# the question's expression can be copied verbatim into a calculator call).
OPERATORS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class Task:
    """A task: how to make its env, its prompts and its ideal conversations.

    ``prompt(seed, index)`` is a pure function of its arguments, so a prompt stream can be
    resumed from an index. ``demonstration(prompt)`` is the full ideal conversation (the env's
    opening messages included) for a supervised warm-up; replaying it through a fresh env
    earns the maximum reward (1.0). Either may be None for a task that only has an env (its
    prompts then come from a file, ``data.path``, and there is no warm-up); what a run needs is
    checked when the task is resolved (``axrl.agents.tasks.resolve_task``).
    """

    name: str
    make_env: Callable[[], Env]
    prompt: Callable[[int, int], Prompt] | None = None
    demonstration: Callable[[Prompt], list[Message]] | None = None
    description: str = ""

    def prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """The endless prompt stream ``prompt(seed, start), prompt(seed, start + 1), …``."""
        if self.prompt is None:
            raise ValueError(f"task {self.name!r} has no prompt generator; give prompts with data.path")
        index = start
        while True:
            yield self.prompt(seed, index)
            index += 1


def make_config(cls: type, task: str, options: dict[str, Any]) -> Any:
    """Build a task's config dataclass from keyword options, naming the valid ones on a typo."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"task {task!r}: unknown option(s) {unknown}; valid options: {known}")
    return cls(**options)


def check_operands(task: str, lo: int, hi: int, ops: tuple[str, ...]) -> None:
    """Validate operand range and operators of an arithmetic-style task config."""
    if lo > hi:
        raise ValueError(f"task {task!r}: min_operand {lo} > max_operand {hi}")
    bad = [op for op in ops if op not in OPERATORS]
    if bad or not ops:
        raise ValueError(f"task {task!r}: ops must be a non-empty subset of {list(OPERATORS)}, got {list(ops)}")


def prompt_rng(seed: int, index: int) -> np.random.Generator:
    """The generator for prompt ``index`` of stream ``seed``: seeded by the pair alone (numpy's
    SeedSequence mixes both), so a prompt does not depend on how many were drawn before."""
    return np.random.default_rng([abs(int(seed)), int(index)])


def sample_problem(seed: int, index: int, lo: int, hi: int, ops: tuple[str, ...]) -> tuple[int, str, int]:
    """Operands and operator of problem ``index`` in stream ``seed``: ``(a, op, b)``."""
    rng = prompt_rng(seed, index)
    a, b = (int(x) for x in rng.integers(lo, hi + 1, size=2))
    return a, ops[int(rng.integers(len(ops)))], b


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*\$?\s*(" + _NUMBER + ")", re.I)
_ANY_NUMBER = re.compile(_NUMBER)


def parse_answer(text: str) -> Fraction | None:
    """The numeric answer in ``text``: the last "answer is N" if there is one, else the last
    number in the text; None when there is no number. Thousands separators are accepted."""
    found = _ANSWER_IS.findall(text) or _ANY_NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def expected_answer(prompt: Prompt) -> Fraction:
    """The ``answer`` field of a prompt as an exact number (int, float or numeric string)."""
    if "answer" not in prompt.fields:
        raise ValueError(f"prompt {prompt.prompt_id!r} has no 'answer' field")
    value = prompt.fields["answer"]
    try:
        return Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"prompt {prompt.prompt_id!r}: answer {value!r} is not a number") from exc


def format_number(value: Fraction | int) -> str:
    """Exact, human-readable number: ``95``, ``-3``, ``2.5``; non-terminating fractions as ``1/3``."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # terminating decimal: print it exactly
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        sign = "-" if value < 0 else ""
        scaled = abs(value.numerator) * 10**digits // value.denominator
        return f"{sign}{scaled // 10**digits}.{scaled % 10**digits:0{digits}d}"
    return f"{value.numerator}/{value.denominator}"
