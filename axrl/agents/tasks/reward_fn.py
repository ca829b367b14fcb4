"""A task made of a reward function: for prompt files (``data.path``) scored by the user's code.

``data.reward: "my_package.my_module:score"`` names ``score(prompt: Prompt, response: str) ->
float``: each episode is one assistant reply to the prompt's messages, rewarded by the function
(``prompt.fields`` holds the file's other columns, e.g. ``answer``). There are no task prompts
(they come from the file) and no demonstrations (no warm-up).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task

RewardFn = Callable[[Prompt, str], float]


class RewardFnEnv:
    """One turn: the prompt's messages, then the reply scored by ``reward``."""

    def __init__(self, reward: RewardFn, name: str) -> None:
        self.tools: list[dict[str, Any]] = []
        self._reward, self._name = reward, name
        self._prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> list[Message]:
        """The prompt as chat messages."""
        self._prompt = prompt
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        """Score the reply and end the episode."""
        if self._prompt is None:
            raise RuntimeError("step() before reset()")
        value = self._reward(self._prompt, action)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward function {self._name} returned {value!r} for prompt "
                             f"{self._prompt.prompt_id!r}; it must return a finite number")
        return StepOutcome([], float(value), True, {})


def make_reward_task(reward: RewardFn, name: str) -> Task:
    """The single-turn task that ``reward`` (named ``name`` in messages) scores."""
    return Task(name=f"reward:{name}", make_env=lambda: RewardFnEnv(reward, name),
                description=f"single turn on file prompts, scored by {name}")
