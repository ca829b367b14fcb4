"""`verifiers` environments (``verifiers==0.4.0``, the ``verifiers.v1`` API) trained unchanged.

An environment written with the library's own classes (a ``vf.Taskset`` of ``vf.Task`` s whose
``@vf.reward`` methods are its rubric, run by a ``vf.SingleAgentEnv`` or any ``vf.Env``) is
loaded from ``module:attr`` / ``path/file.py:attr`` — an ``Env`` instance or a function
returning one — and played as a black-box agent (``agent.function``):

* its tasks become the run's prompts (``data.task: axrl.agents.tasks.verifiers:make_task``);
* each episode runs ``env.run_episode(task, ctx)`` where ``ctx``'s OpenAI-compatible client is the
  episode's session of AxRL's recording proxy, so every model call the environment's harness makes
  is recorded token-in/token-out like any black-box agent's;
* the episode's reward (the traces' weighted reward sum, the library's own ``Trace.reward``) is
  posted to the session (``POST /sessions/{id}/reward``);
* an episode the library marks failed (a rubric that raised, a harness or provider error, the
  library's own timeouts) raises here, so AxRL records a failed sample with the library's error
  (the agent-failure policy: the step goes on).

The environment is served (``env.serving()``: its interception server and shared tool servers)
once per process, on an event loop of its own in a daemon thread; episodes from the rollout and
the evaluator threads are submitted to it.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_VAR = "AXRL_VERIFIERS_ENVIRONMENT"  # the loaded spec, for agents run in other processes
PIN = "verifiers==0.4.0"


def library() -> Any:
    """``verifiers.v1``, or a ValueError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(f"a verifiers environment needs the verifiers package: pip install {PIN}") from None
    return vf


def _uv_on_path() -> None:
    """verifiers' chat harness runs under ``uv``: a ``uv`` installed beside this interpreter (the
    ``test`` extra installs it into the environment) is found even when the environment's bin
    folder is not on ``PATH`` (a venv's python run without activating it)."""
    here = Path(sys.executable).parent
    if shutil.which("uv") is None and (here / "uv").is_file():
        os.environ["PATH"] = os.pathsep.join([str(here), os.environ.get("PATH", "")])


def _import_spec(spec: str) -> Any:
    """The object ``spec`` names. A ``path/file.py`` module is imported under its own name with its
    directory on ``sys.path`` (and on the ``PYTHONPATH`` of subprocesses): verifiers imports a
    taskset by its top-level module name, and runs tool servers as ``python -m <module>``."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"data.task_args.environment: {spec!r} is not 'package.module:name' or 'path/file.py:name'")
    if module.endswith(".py"):
        path = Path(module).resolve()
        if not path.is_file():
            raise ValueError(f"data.task_args.environment: no file {path}")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if folder not in parts:
            os.environ["PYTHONPATH"] = os.pathsep.join([folder, *parts])
        module = path.stem
    from axrl.agents.tasks.resolve import load_object
    return load_object(f"{module}:{attr}", "data.task_args.environment")


@dataclass
class EpisodeResult:
    """One episode as the library scored it."""

    reward: float
    rewards: dict[str, float] = field(default_factory=dict)   # per component, weighted (name -> value)
    metrics: dict[str, float] = field(default_factory=dict)
    replies: list[str] = field(default_factory=list)

    def columns(self) -> dict[str, float]:
        """The trace's per-sample columns: ``reward.NAME`` (weighted: they add up to the reward)
        and ``metric.NAME``."""
        return {**{f"reward.{k}": v for k, v in self.rewards.items()},
                **{f"metric.{k}": v for k, v in self.metrics.items()}}


class VerifiersEnvironment:
    """A loaded environment: its tasks, and episodes run on its own serving event loop."""

    def __init__(self, spec: str, env: Any) -> None:
        vf = library()
        if not isinstance(env, vf.Env):
            what = env.__name__ if isinstance(env, type) else type(env).__name__
            raise ValueError(f"data.task_args.environment {spec!r}: got {what}, not a verifiers.v1 "
                             "Env (build one, e.g. vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={'id': ...})), "
                             "or name a function returning one)")
        self.spec, self.env, self.name = spec, env, env.config.env_id or spec
        try:
            taskset = env.taskset if env.taskset.bounded else None
            self.tasks = list(taskset) if taskset is not None else []
        except Exception as e:  # noqa: BLE001 — the user's load(): name it
            raise ValueError(f"verifiers environment {self.name!r} ({spec}): its taskset's load() raised "
                             f"{type(e).__name__}: {e}") from e
        if taskset is None:
            raise ValueError(f"verifiers environment {self.name!r} ({spec}): the taskset is infinite; bound it "
                             "(taskset.take(n)) in the function that builds the environment")
        if not self.tasks:
            raise ValueError(f"verifiers environment {self.name!r} ({spec}): its taskset yielded no task "
                             "(an empty dataset); check the taskset's load() and its config")
        self.by_text: dict[str, int] = {}
        for i, task in enumerate(self.tasks):
            text = task_text(task)
            if text in self.by_text and self.tasks[self.by_text[text]].hash != task.hash:
                raise ValueError(f"verifiers environment {self.name!r}: tasks {self.by_text[text]} and {i} have the "
                                 f"same prompt but different data ({text[:80]!r}); AxRL's agent is given the prompt "
                                 "text, so prompts must tell tasks apart")
            self.by_text.setdefault(text, i)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._serving: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _serving_loop(self) -> asyncio.AbstractEventLoop:
        """Start (once) the thread whose loop holds ``env.serving()`` open for the process's life."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    self._ready = loop.create_future()
                    self._serving = loop.create_task(self._serve())
                    started.set()
                    loop.run_forever()
                    loop.close()

                self._thread = threading.Thread(target=main, name="axrl-verifiers", daemon=True)
                self._thread.start()
                started.wait()
                self._loop = loop
                atexit.register(self.close)
            return self._loop

    def close(self, timeout: float = 10.0) -> None:
        """Leave ``env.serving()`` (its interception server, its tool-server processes) and stop the loop."""
        loop, task = self._loop, self._serving
        if loop is None or task is None or loop.is_closed():
            return

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout)
        except Exception:  # noqa: BLE001 — best effort at exit; the processes die with us anyway
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        self._loop = None

    async def _serve(self) -> None:
        assert self._ready is not None
        try:
            async with self.env.serving():
                self._ready.set_result(None)
                await asyncio.Event().wait()  # until the process exits (daemon thread)
        except Exception as e:  # noqa: BLE001 — reported to every episode waiting on it
            if not self._ready.done():
                self._ready.set_exception(e)

    async def _episode(self, task: Any, ctx: Any) -> Any:
        assert self._ready is not None
        await asyncio.shield(self._ready)
        return await self.env.run_episode(task, ctx)

    def run(self, index: int, base_url: str, api_key: str, model: str) -> EpisodeResult:
        """Play task ``index`` against ``base_url`` (blocking); a failed episode raises RuntimeError."""
        vf = library()
        # The library reads the key from an environment variable named in the client config: one
        # variable per session key, so concurrent episodes never see each other's.
        var = "AXRL_VF_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
        os.environ[var] = api_key
        try:
            ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var=var))
            future = asyncio.run_coroutine_threadsafe(self._episode(self.tasks[index], ctx), self._serving_loop())
            episode = future.result()
        finally:
            os.environ.pop(var, None)
        return self._result(episode)

    def _result(self, episode: Any) -> EpisodeResult:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.traces:
            stops = sorted({t.stop_condition for t in episode.traces if t.stop_condition})
            what = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no trace"
            raise RuntimeError(f"verifiers environment {self.name!r}: episode failed "
                               f"({', '.join(stops) or 'error'}): {what}"[:4000])
        # Several agents' traces (a multi-agent Env): their mean, so the scale is one trace's (the
        # weighted components then still add up to the reward).
        n = len(episode.traces)
        rewards: dict[str, float] = {}
        metrics: dict[str, float] = {}
        for t in episode.traces:
            for name, r in t.rewards.items():
                if r is not None:
                    rewards[name] = rewards.get(name, 0.0) + r.value / n
            for name, v in t.metrics.items():
                if v is not None:
                    metrics[name] = metrics.get(name, 0.0) + float(v) / n
        reward = sum(t.reward for t in episode.traces) / n
        return EpisodeResult(reward=float(reward), rewards=rewards, metrics=metrics,
                             replies=[t.last_reply for t in episode.traces])


def task_text(task: Any) -> str:
    """What AxRL's agent is given for ``task``: its prompt text (a chat prompt: the last user message)."""
    prompt = task.data.prompt
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    users = [m for m in prompt if getattr(m, "role", None) == "user"] or list(prompt)
    content = getattr(users[-1], "content", "") if users else ""
    if isinstance(content, list):  # content parts: the text ones
        return "".join(getattr(p, "text", "") or "" for p in content)
    return str(content or "")


_LOADED: dict[str, VerifiersEnvironment] = {}
_LOADED_LOCK = threading.Lock()


def load_environment(spec: str) -> VerifiersEnvironment:
    """The environment ``spec`` names (loaded once per process)."""
    with _LOADED_LOCK:
        if spec not in _LOADED:
            vf = library()
            _uv_on_path()
            obj = _import_spec(spec)
            if callable(obj) and not isinstance(obj, (vf.Env, type)):  # a class is not a builder
                try:
                    obj = obj()
                except Exception as e:  # noqa: BLE001 — the user's builder: name it
                    raise ValueError(f"data.task_args.environment {spec!r}: building the environment raised "
                                     f"{type(e).__name__}: {e}") from e
            _LOADED[spec] = VerifiersEnvironment(spec, obj)
            os.environ[ENV_VAR] = spec
        return _LOADED[spec]


def active() -> VerifiersEnvironment:
    """The environment this process trains (the one ``data.task: axrl.agents.tasks.verifiers:make_task`` loaded)."""
    with _LOADED_LOCK:
        if len(_LOADED) == 1:
            return next(iter(_LOADED.values()))
    spec = os.environ.get(ENV_VAR)
    if not spec:
        raise RuntimeError("agent.function axrl.agents.verifiers_env:play needs data.task: "
                           "axrl.agents.tasks.verifiers:make_task (data.task_args.environment names the environment)")
    return load_environment(spec)


def play(base_url: str, api_key: str, prompt: str) -> dict[str, Any]:
    """``agent.function`` for verifiers environments: run the prompt's task through the session
    at ``base_url``, post the library's reward to the session; returns ``{"columns": ...}``, the
    rubric's weighted components and the metrics, which AxRL records per sample
    (``/samples/reward.NAME``, ``/samples/metric.NAME``), and ``"result"``, the ``EpisodeResult``."""
    import httpx

    env = active()
    if prompt not in env.by_text:
        raise RuntimeError(f"verifiers environment {env.name!r}: no task has the prompt {prompt[:80]!r}")
    model = os.environ.get("AXRL_VERIFIERS_MODEL", "axrl-policy")
    result = env.run(env.by_text[prompt], base_url, api_key, model)
    root = base_url.rstrip("/").removesuffix("/v1")
    reply = httpx.post(f"{root}/reward", json={"reward": result.reward},
                       headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    reply.raise_for_status()
    return {"columns": result.columns(), "result": result}
