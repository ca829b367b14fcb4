"""reasoning-gym tasks: any procedural dataset of ``reasoning_gym`` (0.1.25) as a single-turn task.

``data.task: reasoning_gym`` with ``data.task_args``::

    name: basic_arithmetic          # a dataset registered in reasoning_gym (the default), or `datasets:`
    config: {min_terms: 2, ...}     # that dataset's config fields (its *Config dataclass)
    system_prompt: default          # a key of reasoning_gym.utils.SYSTEM_PROMPTS, or null for none

or a weighted composite (the library's own ``CompositeDataset``)::

    datasets:
      - {name: basic_arithmetic, weight: 2, config: {...}}
      - {name: letter_counting, weight: 1}

The prompt is the library's documented format (a system prompt from ``SYSTEM_PROMPTS`` asking for
``<answer>…</answer>``, then the dataset's ``question``); the reply's answer is taken with the
library's ``extract_answer`` and scored by the dataset's own ``score_answer`` (the reward, in
[0, 1]). Demonstrations for the warm-up are the dataset's answers in answer tags.

Splits: the prompt stream ``seed`` only ever yields questions whose hash falls in bucket
``seed % 3``; a run draws training prompts from ``seed``, warm-up demonstrations from ``seed + 1``
and held-out evaluation from ``seed + 2`` (see axrl.runtime), so its eval questions never equal a
training or warm-up question, even for a small config whose question space is tiny.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from axrl.agents.env import Message, Prompt, StepOutcome
from axrl.agents.tasks.common import Task

NAME = "reasoning_gym"
SPLITS = 3  # train (seed), warm-up (seed + 1), eval (seed + 2): three disjoint question buckets
MAX_DRAWS = 256  # candidates tried per prompt before the config is declared too small
_INDEX_SPACE = 2**31  # dataset items are generated from Random(seed + idx): any int works
_OPTIONS = ("name", "config", "datasets", "system_prompt")
DEFAULT_DATASET = "basic_arithmetic"


def _library() -> Any:
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401 — SYSTEM_PROMPTS and extract_answer live here
    except ImportError:
        raise ValueError("data.task: reasoning_gym needs the reasoning-gym package: "
                         "pip install reasoning-gym==0.1.25") from None
    return reasoning_gym


def _build_dataset(rg: Any, name: str | None, config: dict[str, Any],
                   datasets: list[dict[str, Any]] | None) -> tuple[Any, str]:
    """The library's dataset (seed 0, huge virtual size: items are indexed by a derived index)."""
    if (name is None) == (datasets is None):
        raise ValueError("data.task_args for reasoning_gym: give exactly one of 'name' (one dataset) "
                         "or 'datasets' (a weighted composite)")
    try:
        if name is not None:
            return rg.create_dataset(name, seed=0, size=_INDEX_SPACE, **config), name
        from reasoning_gym.composite import DatasetSpec
        specs = []
        for i, spec in enumerate(datasets or []):
            unknown = sorted(set(spec) - {"name", "weight", "config"})
            if "name" not in spec or unknown:
                raise ValueError(f"datasets[{i}] needs 'name' and may have 'weight', 'config' (got {sorted(spec)})")
            specs.append(DatasetSpec(name=spec["name"], weight=float(spec.get("weight", 1.0)),
                                     config=dict(spec.get("config") or {})))
        if not specs:
            raise ValueError("'datasets' is empty: list at least one {name, weight, config}")
        label = "+".join(s.name for s in specs)
        return rg.create_dataset("composite", seed=0, size=_INDEX_SPACE, datasets=specs), label
    except ValueError as e:
        known = sorted(rg.factory.DATASETS)
        raise ValueError(f"data.task_args for reasoning_gym: {e} (datasets: {', '.join(known)})") from None
    except (TypeError, AssertionError) as e:  # the library's config dataclass / validate()
        raise ValueError(f"data.task_args.config for reasoning_gym {name or datasets}: {type(e).__name__}: {e}; "
                         "see the dataset's *Config class for its fields") from None


def _bucket(question: str) -> int:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % SPLITS


def _candidate(seed: int, index: int, draw: int) -> int:
    """Dataset index of candidate ``draw`` for prompt ``index`` of stream ``seed`` (pure)."""
    rng = np.random.default_rng([abs(int(seed)), int(index), int(draw)])
    return int(rng.integers(_INDEX_SPACE))


class ReasoningGymEnv:
    """One question; the reply's ``<answer>`` is scored by the dataset's ``score_answer``."""

    def __init__(self, dataset: Any, label: str) -> None:
        self.tools: list[dict[str, Any]] = []
        self._dataset, self._label = dataset, label
        self._entry: dict[str, Any] | None = None
        self._messages: list[Message] = []

    def reset(self, prompt: Prompt) -> list[Message]:
        """The prompt's messages; the dataset entry is regenerated from its recorded index."""
        if "rg_index" not in prompt.fields:
            raise ValueError(f"prompt {prompt.prompt_id!r} has no 'rg_index' field: reasoning_gym prompts "
                             "come from the task's own generator, not from data.path")
        self._entry = self._dataset[int(prompt.fields["rg_index"])]
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        """Extract the answer the library's way, score it with the dataset, end the episode."""
        if self._entry is None:
            raise RuntimeError("step() before reset()")
        from reasoning_gym.utils import extract_answer
        answer = extract_answer(action)
        try:
            score = float(self._dataset.score_answer(answer, self._entry))
        except Exception as e:  # noqa: BLE001 — the library's verifier: name it in the failure
            raise RuntimeError(f"reasoning_gym {self._label}: score_answer raised "
                               f"{type(e).__name__}: {e} on answer {answer!r}") from e
        return StepOutcome([], score, True, {"answer": answer, "correct": score >= 1.0})


def make_task(**options: Any) -> Task:
    """The reasoning-gym task; options: ``name`` + ``config``, or ``datasets``; ``system_prompt``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"task {NAME!r}: unknown option(s) {unknown}; valid options: {list(_OPTIONS)}")
    rg = _library()
    # Without either, the library's basic_arithmetic with its defaults: every built-in task
    # works with no task_args (the registry's contract, tests/test_agents.py).
    name = options.get("name", None if "datasets" in options else DEFAULT_DATASET)
    dataset, label = _build_dataset(rg, name, dict(options.get("config") or {}), options.get("datasets"))
    key = options.get("system_prompt", "default")
    prompts = rg.utils.SYSTEM_PROMPTS
    if key is not None and key not in prompts:
        raise ValueError(f"data.task_args.system_prompt: {key!r} is not one of {sorted(prompts)} (or null)")
    system = None if key is None else prompts[key]

    def prompt(seed: int, index: int) -> Prompt:
        for draw in range(MAX_DRAWS):
            idx = _candidate(seed, index, draw)
            entry = dataset[idx]
            if _bucket(entry["question"]) == seed % SPLITS:
                messages: list[Message] = ([{"role": "system", "content": system}] if system else [])
                messages.append({"role": "user", "content": entry["question"]})
                return Prompt(prompt_id=f"rg-{label}-{seed}-{index}", messages=messages,
                              fields={"rg_index": idx, "answer": str(entry["answer"])})
        raise ValueError(f"reasoning_gym {label}: no question of split {seed % SPLITS} in {MAX_DRAWS} draws: "
                         "the config yields (almost) no distinct questions; widen it")

    def demonstration(p: Prompt) -> list[Message]:
        return p.as_messages() + [{"role": "assistant", "content": f"<answer>{p.fields['answer']}</answer>"}]

    prompt(0, 0)  # fail at start-up, not in a rollout, when the config yields nothing usable
    return Task(name=f"{NAME}:{label}", make_env=lambda: ReasoningGymEnv(dataset, label),
                prompt=prompt, demonstration=demonstration,
                description=f"reasoning-gym {label}: single turn, scored by the dataset's score_answer")
