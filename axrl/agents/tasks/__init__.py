"""Built-in tasks and their registry.

>>> task = get_task("calculator", max_operand=50)
>>> env, prompt = task.make_env(), task.prompt(seed=0, index=0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from axrl.agents.tasks import arithmetic, calculator, echo, reasoning_gym
from axrl.agents.tasks.common import Task

# name -> factory taking the task's options as keywords.
TASKS: dict[str, Callable[..., Task]] = {
    arithmetic.NAME: arithmetic.make_task,
    calculator.NAME: calculator.make_task,
    echo.NAME: echo.make_task,
    reasoning_gym.NAME: reasoning_gym.make_task,  # imports the library only when used
}


def get_task(name: str, /, **options: Any) -> Task:
    """The built-in task ``name`` configured with ``options`` (see each module's ``*Config``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Task", "get_task"]
