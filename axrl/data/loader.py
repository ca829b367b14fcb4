"""Where prompts come from: a built-in task's generator or a file of prompts.

File format (JSONL: one JSON object per line; Parquet: one row per prompt)::

    {"prompt": "What is 37 + 58?", "answer": 95}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "prompt_id": "q-17", "answer": "12"}

``prompt`` is a string (one user message) or a list of chat messages; ``prompt_id`` is
optional (default ``"{file stem}-{row index}"``, 0-based); every other column becomes a task
field (``Prompt.fields``), e.g. the ``answer`` the env scores against. Bad rows raise
:class:`PromptDataError` naming the file and the line (JSONL, 1-based) or row (Parquet, 0-based).

Order is a pure function of the seed and the position: a task stream yields prompts
``index, index + 1, …``; a file is read in epochs, each a permutation seeded by
``(seed, epoch)`` (or file order with ``shuffle=False``). ``state()`` / ``load_state()`` save
and restore the position for resume.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from axrl.agents.env import Message, Prompt
from axrl.agents.tasks import Task, get_task

ROLES = ("system", "user", "assistant", "tool")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
TASK_PREFIX = "task:"


class PromptDataError(ValueError):
    """A prompt file that cannot be read, or a row in it that is not a valid prompt."""


class PromptLoader:
    """Deterministic, resumable batches of prompts. Build with :meth:`from_task`,
    :meth:`from_file` or :meth:`from_source`."""

    def __init__(self, *, seed: int, task: Task | None = None, rows: list[Prompt] | None = None,
                 source: str, shuffle: bool = True) -> None:
        """Prefer the ``from_*`` constructors. Exactly one of ``task`` and ``rows`` is given."""
        if (task is None) == (rows is None):
            raise ValueError("PromptLoader needs exactly one of task and rows")
        if rows is not None and not rows:
            raise PromptDataError(f"{source}: no prompts")
        self.seed = int(seed)
        self.source = source
        self.shuffle = shuffle
        self._task = task
        self._rows = rows
        # Task streams: index of the next prompt. Files: epoch and position within it.
        self._index = 0
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0) if rows is not None else None
        self._cached_order: tuple[int, np.ndarray | None] = (-1, None)  # prompt_at's epoch permutation
        # Detects other data on resume (an edited file, other task options): the position would
        # then silently point at different prompts. A task stream is probed by its first prompt.
        self._digest = _digest(rows if rows is not None else [task.prompt(self.seed, 0)])

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_task(cls, task: str | Task, seed: int = 0, **options: Any) -> PromptLoader:
        """Endless prompts of a built-in task (``options`` configure it, e.g. ``max_operand``)."""
        if isinstance(task, str):
            task = get_task(task, **options)
        elif options:
            raise ValueError("task options only apply when the task is given by name")
        return cls(seed=seed, task=task, source=TASK_PREFIX + task.name)

    @classmethod
    def from_file(cls, path: str | Path, seed: int = 0, shuffle: bool = True) -> PromptLoader:
        """Prompts of a JSONL or Parquet file, in epochs (reshuffled per epoch unless ``shuffle`` is off)."""
        return cls(seed=seed, rows=read_prompt_file(path), source=str(path), shuffle=shuffle)

    @classmethod
    def from_source(cls, source: str, seed: int = 0, **options: Any) -> PromptLoader:
        """``"task:NAME"`` for a built-in task (``options`` configure it), else a file path
        (``options`` may hold ``shuffle``)."""
        if source.startswith(TASK_PREFIX):
            return cls.from_task(source[len(TASK_PREFIX):], seed=seed, **options)
        return cls.from_file(source, seed=seed, **options)

    # -- iteration ----------------------------------------------------------------------

    @property
    def task(self) -> Task | None:
        """The task of a task-backed loader (None for files)."""
        return self._task

    @property
    def position(self) -> int:
        """Stream position of the next prompt `next_batch` would return (across epochs)."""
        if self._task is not None:
            return self._index
        return self._epoch * len(self) + self._position

    @property
    def epoch(self) -> int:
        """0-based index of the epoch being read (always 0 for task streams, which never end)."""
        return self._epoch

    def __len__(self) -> int:
        """Prompts per epoch of a file; task streams are endless and have no length."""
        if self._rows is None:
            raise TypeError("a task prompt stream has no length")
        return len(self._rows)

    def prompt_at(self, position: int) -> Prompt:
        """The prompt at stream position `position` (0-based, across epochs), whatever has been
        read so far: a pure function of (data, seed, position)."""
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        if self._task is not None:
            return self._task.prompt(self.seed, position)
        assert self._rows is not None
        epoch, row = divmod(position, len(self._rows))
        if self._cached_order[0] != epoch:
            self._cached_order = (epoch, self._epoch_order(epoch))
        return copy.deepcopy(self._rows[self._cached_order[1][row]])  # callers may mutate

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (files wrap into the next, reshuffled epoch as needed)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        if self._task is not None:
            batch = [self._task.prompt(self.seed, i) for i in range(self._index, self._index + n)]
            self._index += n
            return batch
        assert self._rows is not None and self._order is not None
        batch = []
        for _ in range(n):
            if self._position == len(self._rows):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            batch.append(copy.deepcopy(self._rows[self._order[self._position]]))  # callers may mutate
            self._position += 1
        return batch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        assert self._rows is not None
        if not self.shuffle:
            return np.arange(len(self._rows))
        return np.random.default_rng([abs(self.seed), epoch]).permutation(len(self._rows))

    # -- resume -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The data position, JSON-serialisable (goes into checkpoints)."""
        if self._task is not None:
            return {"source": self.source, "seed": self.seed, "index": self._index, "digest": self._digest}
        return {"source": self.source, "seed": self.seed, "shuffle": self.shuffle, "epoch": self._epoch,
                "position": self._position, "num_rows": len(self), "digest": self._digest}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state` on a loader of the same data.

        Raises ValueError when the state belongs to other data (another task, task options, seed
        or file contents): resuming on it would silently change what is trained on.
        """
        mine = self.state()
        # A file may have moved: its identity is its contents (digest), not its path.
        keys = ("source", "seed", "digest") if self._task is not None else ("seed", "shuffle", "num_rows", "digest")
        for key in keys:
            if state.get(key) != mine[key]:
                raise ValueError(f"data state does not match this loader: {key} is "
                                 f"{state.get(key)!r} in the state, {mine[key]!r} here")
        if self._task is not None:
            self._index = int(state["index"])
            return
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"data state position {position} outside 0..{len(self)}")
        self._epoch, self._position, self._order = epoch, position, self._epoch_order(epoch)


# ---------------------------------------------------------------------------- files


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """All prompts of a JSONL or Parquet file, validated (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows = _read_jsonl(path)
    elif suffix in PARQUET_SUFFIXES:
        rows = _read_parquet(path)
    else:
        raise PromptDataError(f"{path}: unknown prompt file type {suffix!r}; use one of "
                              f"{list(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(rows):
        prompt = _row_to_prompt(row, f"{path} {where}", default_id=f"{path.stem}-{index}")
        if prompt.prompt_id in seen:
            raise PromptDataError(f"{path} {where}: prompt_id {prompt.prompt_id!r} already used at "
                                  f"{seen[prompt.prompt_id]}")
        seen[prompt.prompt_id] = where
        prompts.append(prompt)
    return prompts


def _digest(prompts: list[Prompt]) -> str:
    """Short content hash of a prompt list (ids, text and fields)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(dataclasses.asdict(p), sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise PromptDataError(f"{path} line {lineno}: invalid JSON: {exc.msg} "
                                      f"(column {exc.colno})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # optional dependency: only Parquet prompt files need it
        raise PromptDataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise PromptDataError(f"{path}: not a readable Parquet file: {exc}") from None
    # Parquet has a schema, so a column absent from a row reads as None: drop those.
    return [(f"row {i}", {k: v for k, v in row.items() if v is not None})
            for i, row in enumerate(table.to_pylist())]


def _row_to_prompt(row: Any, where: str, default_id: str) -> Prompt:
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: expected an object with a 'prompt' field, got {type(row).__name__}")
    fields = dict(row)
    if "prompt" not in fields:
        raise PromptDataError(f"{where}: missing required field 'prompt' (fields: {sorted(fields)})")
    value = fields.pop("prompt")
    prompt_id = fields.pop("prompt_id", None)
    if prompt_id is None:
        prompt_id = default_id
    elif isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)) or prompt_id == "":
        raise PromptDataError(f"{where}: prompt_id must be a non-empty string or an integer, got {prompt_id!r}")
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: 'prompt' is an empty string")
        return Prompt(prompt_id=str(prompt_id), text=value, fields=fields)
    if isinstance(value, list) and value:
        return Prompt(prompt_id=str(prompt_id), messages=[_message(m, where, i) for i, m in enumerate(value)],
                      fields=fields)
    raise PromptDataError(f"{where}: 'prompt' must be a non-empty string or a non-empty list of chat "
                          f"messages, got {type(value).__name__}")


def _message(message: Any, where: str, index: int) -> Message:
    if not isinstance(message, dict):
        raise PromptDataError(f"{where}: prompt message {index} is not an object")
    message = {k: v for k, v in message.items() if v is not None}  # Parquet struct padding
    if message.get("role") not in ROLES:
        raise PromptDataError(f"{where}: prompt message {index} has role {message.get('role')!r}; "
                              f"expected one of {list(ROLES)}")
    if not isinstance(message.get("content"), str):
        raise PromptDataError(f"{where}: prompt message {index} needs a string 'content'")
    return message
