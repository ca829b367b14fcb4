"""A cheap synthetic multi-turn env: the user says a word, the assistant repeats it, N times.

Meant for stress tests of the agent loop (hundreds of turns, long streams) and as the smallest
multi-turn task a model can learn. Every observation is one short user message (the next
word). The episode ends after ``turns`` assistant replies; its reward, given at the last step,
is the fraction of replies that were exactly the word (after stripping whitespace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task, make_config, prompt_rng

NAME = "echo"
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree",
         "fish", "bird", "star", "rain", "snow", "wind", "fire", "stone")


@dataclass(frozen=True)
class EchoConfig:
    """Options of the echo task (``get_task("echo", **options)``).

    ``long_share`` of the prompts (drawn per prompt) ask for ``long_turns`` words instead of
    ``turns``: a heavy tail of long episodes, as agentic tasks have (benchmarks of async rollout).
    """

    turns: int = 3
    long_turns: int = 0
    long_share: float = 0.0


class EchoEnv:
    """Repeat-after-me for ``len(prompt.fields["words"])`` turns."""

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        self._words: list[str] = []
        self._turn = 0
        self._correct = 0

    def reset(self, prompt: Prompt) -> list[Message]:
        """The instruction with the first word."""
        words = prompt.fields.get("words")
        if not words or not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"prompt {prompt.prompt_id!r}: 'words' must be a non-empty list of words")
        self._words, self._turn, self._correct = list(words), 0, 0
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        """Check the echo; answer with the next word, or end with the score."""
        if self._turn >= len(self._words):
            raise RuntimeError("step() after the episode ended (or before reset())")
        self._correct += action.strip() == self._words[self._turn]
        self._turn += 1
        if self._turn == len(self._words):
            return StepOutcome([], self._correct / len(self._words), True, {"correct": self._correct})
        return StepOutcome([{"role": "user", "content": self._words[self._turn]}], 0.0, False, {})


def make_prompt(seed: int, index: int, config: EchoConfig) -> Prompt:
    """Episode ``index`` of stream ``seed``: ``config.turns`` words drawn from :data:`WORDS`."""
    rng = prompt_rng(seed, index)
    turns = config.turns
    if config.long_share > 0:  # drawn only then, so plain echo streams are unchanged
        turns = config.long_turns if rng.random() < config.long_share else config.turns
    words = [WORDS[int(i)] for i in rng.integers(len(WORDS), size=turns)]
    return Prompt(prompt_id=f"{NAME}-{seed}-{index}", text=f"Repeat each word I say. {words[0]}",
                  fields={"words": words})


def demonstration(prompt: Prompt) -> list[Message]:
    """The ideal conversation: every word echoed."""
    words = prompt.fields["words"]
    messages = EchoEnv().reset(prompt)
    for i, word in enumerate(words):
        messages.append({"role": "assistant", "content": word})
        if i + 1 < len(words):
            messages.append({"role": "user", "content": words[i + 1]})
    return messages


def make_task(**options: Any) -> Task:
    """The echo task; options are :class:`EchoConfig` fields."""
    config = make_config(EchoConfig, NAME, options)
    if config.turns < 1:
        raise ValueError(f"task {NAME!r}: turns must be >= 1, got {config.turns}")
    if not 0.0 <= config.long_share <= 1.0:
        raise ValueError(f"task {NAME!r}: long_share must be in [0, 1], got {config.long_share}")
    if config.long_share > 0 and config.long_turns < 1:
        raise ValueError(f"task {NAME!r}: long_share > 0 needs long_turns >= 1, got {config.long_turns}")
    return Task(
        name=NAME,
        make_env=EchoEnv,
        prompt=lambda seed, index: make_prompt(seed, index, config),
        demonstration=demonstration,
        description="synthetic multi-turn: repeat the word, for N turns (stress tests)",
    )
