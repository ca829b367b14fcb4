"""``data.task: axrl.agents.tasks.verifiers:make_task``: the prompts of a ``verifiers`` (0.4) environment's taskset.

``data.task_args``::

    environment: examples/verifiers_single.py:load_environment   # or package.module:attr
    split: false        # true: train / warm-up / eval prompts from disjoint thirds of the tasks

Each prompt is one of the environment's tasks (its system prompt and prompt messages; the task's
index in ``fields``); the episodes are played by ``agent.function:
axrl.agents.verifiers_env:play`` (docs/agents.md, "verifiers environments"), which runs the
library's own rollout and rubric. A prompt stream ``seed`` visits the tasks in a seeded order
(all of them before any repeats); with ``split: true`` stream ``seed`` only visits the tasks whose
key hashes into bucket ``seed % 3``, so the evaluation (stream ``seed + 2``) never sees a
training task. There are no demonstrations: set ``warmup.steps: 0``.

The task name (recorded in the manifest's ``extra.task``) says the environment is
non-deterministic: its harness is a process of its own whose calls arrive when it makes them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task

NAME = "verifiers"
SPLITS = 3
_OPTIONS = ("environment", "split")


class _PlayedByAgent:
    """The white-box Env slot of the task: its opening is the prompt (start-up checks render it);
    the episodes themselves are the agent's (``agent.function``)."""

    tools: list[dict[str, Any]] = []

    def reset(self, prompt: Prompt) -> list[Message]:
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        raise ValueError("a verifiers environment is played by a black-box agent: set agent.function: "
                         "axrl.agents.verifiers_env:play")


def _messages(task: Any) -> list[Message]:
    """The task's prompt as AxRL chat messages (system prompt first, as the harness sends it)."""
    data = task.data
    out: list[Message] = []
    if getattr(data, "system_prompt", None):
        out.append({"role": "system", "content": str(data.system_prompt)})
    if isinstance(data.prompt, str) or data.prompt is None:
        out.append({"role": "user", "content": data.prompt or ""})
        return out
    for m in data.prompt:
        content = m.content if isinstance(m.content, str) else "".join(getattr(p, "text", "") or ""
                                                                       for p in (m.content or []))
        out.append({"role": m.role, "content": content})
    return out


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % SPLITS


def make_task(**options: Any) -> Task:
    """The task over a verifiers environment's tasks; options: ``environment`` (required), ``split``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"task {NAME!r}: unknown option(s) {unknown}; valid options: {list(_OPTIONS)}")
    if not options.get("environment"):
        raise ValueError("data.task: axrl.agents.tasks.verifiers:make_task needs data.task_args.environment: "
                         "'path/file.py:attr' or 'package.module:attr' naming a verifiers.v1 Env (or a function "
                         "returning one)")
    from axrl.agents.verifiers_env import load_environment

    loaded = load_environment(str(options["environment"]))
    split = bool(options.get("split", False))
    buckets = [[i for i, t in enumerate(loaded.tasks) if not split or _bucket(t.key) == b] for b in range(SPLITS)]
    if split and not all(buckets):
        raise ValueError(f"verifiers environment {loaded.name!r}: split: true leaves a third of its "
                         f"{len(loaded.tasks)} task(s) empty (sizes {[len(b) for b in buckets]}); use split: false")
    pools = buckets if split else [buckets[0]] * SPLITS

    def prompt(seed: int, index: int) -> Prompt:
        pool = pools[seed % SPLITS]
        epoch, pos = divmod(index, len(pool))
        order = np.random.default_rng([abs(int(seed)), epoch]).permutation(len(pool))
        i = pool[int(order[pos])]
        task = loaded.tasks[i]
        return Prompt(prompt_id=f"vf-{loaded.name}-{task.key[:12]}", messages=_messages(task),
                      fields={"vf_index": i, "vf_key": task.key})

    return Task(name=f"{NAME}:{loaded.name} (non-deterministic)", make_env=_PlayedByAgent, prompt=prompt,
                description=f"verifiers environment {loaded.name} ({loaded.spec}): {len(loaded.tasks)} task(s), "
                            "played by its own harness and scored by its own rubric; non-deterministic")
