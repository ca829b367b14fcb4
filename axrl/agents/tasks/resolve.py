"""From ``data.task`` / ``data.reward`` to a Task: built-in names, a user's code, entry points.

``data.task`` is one of

* a built-in task name (``calculator``, ``arithmetic``, ``echo``);
* ``"package.module:attr"`` or ``"path/to/file.py:attr"`` — ``attr`` is a :class:`Task`, a
  function returning one (called with ``data.task_args`` as keywords), or an :class:`Env` class
  (constructed with ``data.task_args``; its prompts come from ``data.path``);
* the name of an entry point in the group ``axrl.tasks`` (a package declares
  ``[project.entry-points."axrl.tasks"] my_task = "my_package.tasks:make_task"``), resolved like
  ``attr`` above.

``data.reward: "package.module:score"`` instead makes the single-turn task of
:mod:`axrl.agents.tasks.reward_fn` over the prompts of ``data.path``. Modules are imported with
the working directory on ``sys.path`` (as ``python -m`` would), so a file next to the config works.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from axrl.agents.env import Env
from axrl.agents.tasks import TASKS
from axrl.agents.tasks.common import Task
from axrl.agents.tasks.reward_fn import make_reward_task

ENTRY_POINT_GROUP = "axrl.tasks"


def load_object(spec: str, key: str) -> Any:
    """The object ``module:attr`` (or ``file.py:attr``; ``attr`` may be dotted) names; errors name ``key``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not 'package.module:name' or 'path/to/file.py:name'")
    try:
        obj: Any = _import(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"{key}: cannot import {module_name!r} ({e}); install the package or run from the "
                         "directory that holds it (the working directory is on the import path)") from None
    except Exception as e:  # the user's module failed while importing: say which and why
        raise ValueError(f"{key}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _import(module_name: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ModuleNotFoundError(f"no file {path}")
        name = f"axrl_user_{path.stem}_{abs(hash(str(path))):x}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before exec: dataclasses and pickling look the module up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module_name)


def _entry_point(name: str) -> Any | None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:  # noqa: BLE001 — a broken plug-in is the user's input
                raise ValueError(f"data.task: entry point {name!r} ({ep.value}) failed to load: "
                                 f"{type(e).__name__}: {e}") from e
    return None


def installed_tasks() -> list[str]:
    """Names of the tasks that installed packages declare (entry point group ``axrl.tasks``)."""
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _check_options(fn: Any, spec: str, options: dict[str, Any]) -> None:
    """data.task_args must fit the signature (checked here: a TypeError from inside the user's
    code must not be blamed on the config)."""
    try:
        inspect.signature(fn).bind(**options)
    except TypeError as e:
        raise ValueError(f"data.task_args {options}: {spec} does not take them ({e})") from None
    except ValueError:  # no signature to check (a builtin): let the call decide
        pass


def _as_task(obj: Any, spec: str, options: dict[str, Any]) -> Task:
    if isinstance(obj, Task):
        if options:
            raise ValueError(f"data.task {spec!r} is a Task object: it takes no data.task_args "
                             f"(got {sorted(options)}); point data.task at a function that builds it")
        return obj
    if inspect.isclass(obj) and callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        cls = obj
        _check_options(cls, spec, options)
        env = cls(**options)  # built once now, so a bad option fails at start-up, not in a rollout
        if not isinstance(env, Env):
            raise ValueError(f"data.task {spec!r}: {cls.__name__} lacks the Env attribute 'tools'")
        return Task(name=spec, make_env=lambda: cls(**options), description=f"env {cls.__name__}")
    if callable(obj):
        _check_options(obj, spec, options)
        task = obj(**options)
        if not isinstance(task, Task):
            raise ValueError(f"data.task {spec!r} returned {type(task).__name__}, not an "
                             "axrl.agents.tasks.Task")
        return task
    raise ValueError(f"data.task {spec!r} is a {type(obj).__name__}: expected a Task, a function returning "
                     "one, or an Env class")


def resolve_task(data: Any, *, warmup: bool, evaluate: bool) -> Task:
    """The Task of a config's ``data`` section (``task``, ``task_args``, ``reward``, ``path``).

    ``warmup`` / ``evaluate``: whether the run does a supervised warm-up (needs the task's prompts
    and demonstrations) and held-out evaluations (needs its prompt generator); what is missing
    is reported here, before any model is built."""
    options = dict(data.task_args)
    if data.reward:
        fn = load_object(data.reward, "data.reward")
        if not callable(fn):
            raise ValueError(f"data.reward {data.reward!r} is a {type(fn).__name__}, not a function")
        task = make_reward_task(fn, data.reward)
    elif data.task in TASKS:
        task = TASKS[data.task](**options)
    else:
        obj = load_object(data.task, "data.task") if ":" in data.task else _entry_point(data.task)
        if obj is None:
            plugins = installed_tasks()
            raise ValueError(f"data.task: unknown task {data.task!r}; built-in tasks: {sorted(TASKS)}"
                             + (f", installed ({ENTRY_POINT_GROUP}): {plugins}" if plugins else "")
                             + "; or 'package.module:make_task' for your own")
        task = _as_task(obj, data.task, options)
    _check_parts(task, data, warmup=warmup, evaluate=evaluate)
    return task


def _check_parts(task: Task, data: Any, *, warmup: bool, evaluate: bool) -> None:
    what = f"data.reward {data.reward!r}" if data.reward else f"data.task {data.task!r}"
    if task.prompt is None:
        for needed, why, fix in ((data.path is None, "the prompts", "set data.path to a JSONL/Parquet prompt file"),
                                 (warmup, "the supervised warm-up", "set warmup.steps: 0"),
                                 (evaluate, "held-out evaluation", "set eval.every: 0")):
            if needed:
                raise ValueError(f"{what} has no prompt generator, which {why} needs; {fix}")
    if warmup and task.demonstration is None:
        raise ValueError(f"{what} has no demonstrations, which the supervised warm-up needs; set warmup.steps: 0")
