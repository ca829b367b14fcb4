"""A complete custom task in one file: look an item's stock up with a tool, then answer.

    axrl train examples/custom_task.yaml        # data.task: examples/custom_task.py:make_task

Ideal episode:
    user       How many bolts are in stock?
    assistant  <tool_call>{"name": "stock", "arguments": {"item": "bolts"}}</tool_call>
    tool       42
    assistant  There are 42.

Reward 1.0 for the right count after a successful lookup, 0.2 for the right count without one,
else 0. AxRL needs only `make_task`: it returns a Task (env factory, prompt generator, and the
demonstrations the supervised warm-up trains on).
"""

from __future__ import annotations

from typing import Any

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task, parse_answer, prompt_rng
from axrl.tokenizer import parse_tool_calls

ITEMS = ("apples", "bolts", "cables", "chairs", "lamps", "pears")
SYSTEM = "Look it up with the stock tool, then reply: There are N."
STOCK_TOOL = {"type": "function", "function": {
    "name": "stock", "description": "Units of an item in stock.",
    "parameters": {"type": "object", "required": ["item"], "properties": {"item": {"type": "string"}}}}}


def make_prompt(seed: int, index: int) -> Prompt:
    """Question `index` of stream `seed`; the whole stock table travels in `fields`."""
    rng = prompt_rng(seed, index)
    table = {item: int(rng.integers(0, 100)) for item in ITEMS}
    item = ITEMS[int(rng.integers(len(ITEMS)))]
    return Prompt(prompt_id=f"stock-{seed}-{index}", text=f"How many {item} are in stock?",
                  fields={"item": item, "stock": table})


class StockEnv:
    """Answers `stock` calls from the prompt's table; scores the first reply without a call."""

    def __init__(self, max_calls: int = 2, show_schema: bool = True) -> None:
        self.max_calls = max_calls
        self.tools = [STOCK_TOOL] if show_schema else []  # the schema goes into the system prompt

    def reset(self, prompt: Prompt) -> list[Message]:
        self.fields, self.calls, self.looked_up = prompt.fields, 0, False
        return [{"role": "system", "content": SYSTEM}, *prompt.as_messages()]

    def step(self, action: str) -> StepOutcome:
        calls = parse_tool_calls(action)
        if not calls:  # the final answer
            expected = self.fields["stock"][self.fields["item"]]
            correct = parse_answer(action) == expected
            return StepOutcome([], (1.0 if self.looked_up else 0.2) if correct else 0.0, True,
                               {"correct": correct, "looked_up": self.looked_up})
        self.calls += len(calls)
        if self.calls > self.max_calls:
            return StepOutcome([], 0.0, True, {"reason": "too many calls"})
        return StepOutcome([{"role": "tool", "content": self.lookup(c)} for c in calls])

    def lookup(self, call: dict[str, Any]) -> str:
        if call["error"] or call["name"] != "stock":
            return f"Error: {call['error'] or 'unknown tool ' + repr(call['name'])}"
        count = self.fields["stock"].get(call["arguments"].get("item"))
        if count is None:
            return f"Error: no item {call['arguments'].get('item')!r}; items: {', '.join(ITEMS)}"
        self.looked_up = True
        return str(count)


def demonstration(prompt: Prompt) -> list[Message]:
    """The ideal conversation, for the supervised warm-up."""
    env, call = StockEnv(), {"name": "stock", "arguments": {"item": prompt.fields["item"]}}
    messages = env.reset(prompt)
    count = env.lookup({"error": None, **call})
    return messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": count},
        {"role": "assistant", "content": f"There are {count}."},
    ]


def make_task(max_calls: int = 2, show_schema: bool = True) -> Task:
    """The entry point `data.task` names; `data.task_args` become its keyword arguments."""
    return Task(name="stock", make_env=lambda: StockEnv(max_calls, show_schema), prompt=make_prompt,
                demonstration=demonstration, description="look an item's stock up, then answer")
