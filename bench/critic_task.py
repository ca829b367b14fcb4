"""A task whose return a value baseline can learn: "bonus" echo.

One turn: the user says a word and the assistant repeats it (as the `echo` task's first turn).
Half of the prompts (drawn per prompt) start with "Bonus round." and pay 0.75 on top of the echo's
0.25 when the word is repeated exactly:

    reward = 0.75 · bonus + 0.25 · correct

so most of the return's variance across episodes is visible in the prompt: a critic that reads
"Bonus round." can predict it before a token is sampled, while a per-group baseline (GRPO) gets it
for free and a batch-mean baseline cannot. Used by tests/test_critic.py and bench/critic_learning.py
as `data.task: bench.critic_task:make_task` (the repository root on the import path).
"""

from __future__ import annotations

from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task, prompt_rng
from axrl.agents.tasks.echo import WORDS

NAME = "bonus-echo"
BONUS, ECHO = 0.75, 0.25


class BonusEchoEnv:
    """One reply: ECHO for the exact word, plus BONUS on a bonus prompt."""

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        self._word: str | None = None
        self._bonus = False

    def reset(self, prompt: Prompt) -> list[Message]:
        """The prompt's one user message."""
        self._word, self._bonus = str(prompt.fields["word"]), bool(prompt.fields["bonus"])
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        """Score the reply and end the episode."""
        if self._word is None:
            raise RuntimeError("step() before reset()")
        correct = action.strip() == self._word
        return StepOutcome([], BONUS * self._bonus + ECHO * correct, True, {"correct": correct, "bonus": self._bonus})


def make_prompt(seed: int, index: int) -> Prompt:
    """Prompt `index` of stream `seed`: a word, and a bonus with probability 1/2."""
    rng = prompt_rng(seed, index)
    word, bonus = WORDS[int(rng.integers(len(WORDS)))], bool(rng.random() < 0.5)
    text = ("Bonus round. " if bonus else "") + f"Repeat the word: {word}"
    return Prompt(prompt_id=f"{NAME}-{seed}-{index}", text=text, fields={"word": word, "bonus": bonus})


def demonstration(prompt: Prompt) -> list[Message]:
    """The ideal conversation: the word repeated."""
    return BonusEchoEnv().reset(prompt) + [{"role": "assistant", "content": prompt.fields["word"]}]


def make_task() -> Task:
    """The bonus-echo task (no options)."""
    return Task(name=NAME, make_env=BonusEchoEnv, prompt=make_prompt, demonstration=demonstration,
                description="one turn: repeat the word; a visible 'Bonus round.' adds 0.75")
