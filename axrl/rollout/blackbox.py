"""Black-box episodes: the user's agent runs against a session of the recording proxy.

An episode is one run of the agent on one prompt: a command started once per episode (with
`OPENAI_BASE_URL` / `OPENAI_API_KEY` — and `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` — set to
its own session, the prompt on stdin or as the last argument) or a Python callable `agent(base_url, api_key, prompt)` run in a thread (which may return
`{"columns": {name: number}}`: per-sample numbers, e.g. reward components, recorded as
`/samples/<name>`). The agent
knows nothing of AxRL; everything it asks the model goes through its session, whose calls go
through this episode's engine handle — so the rollout worker's admission (the staleness bound),
weight updates and partial-rollout policy treat it exactly like a white-box episode.

When the agent exits (or ends its session with `POST /sessions/{id}/end`) the session's
root-to-leaf paths become the episode's trajectories (`axrl.agents.proxy.session`): the
primary one is returned, the forks travel in its `forks` and are pooled with it. The reward
of a path is the verifier's (`agent.verifier`, applied to the finished path's conversation),
else what the agent posted (`POST /sessions/{id}/reward`, final and per-turn).

At most `agent.max_concurrent` agents run at once over the rollout worker's and the evaluator's
event loops together (`AgentSlots`). A plain `python script.py` agent is forked from a fork
server that imported the script's modules once (`axrl.agents.forkserver`): it is still its own
process (pid, environment, stdin, stderr, exit code, kill on timeout), without the ~1 s of
imports of a fresh interpreter per episode.

Failures never stop the step: an agent that exits non-zero, exceeds `agent.timeout_s` (killed),
or never calls the model gives a failed trajectory (status "failed", reward 0; exit code and
stderr tail in `error`), recorded in the trace and never trained on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from axrl.agents.env import Prompt
from axrl.agents.forkserver import ForkServer, forkable
from axrl.agents.proxy import ProxyServer, SessionPolicy, Turn
from axrl.agents.proxy.session import Session
from axrl.core.settings import Section
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import InferenceEngine, SamplingParams

STDERR_TAIL_CHARS = 2000
# verifier(prompt, conversation) -> reward; conversation: the path's messages, normalised
# (role, content, tool_calls [{name, arguments}], name), ending with the last model reply.
Verifier = Callable[[Prompt, list[dict[str, Any]]], float]
AgentFn = Callable[[str, str, str], Any]
_COLUMN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class AgentSettings(Section):
    """A black-box agent (docs/agents.md, "Bring your own agent"): the YAML section `agent` is this
    type, and `BlackBoxPlayer` (the episodes) and the recording proxy (`host`, `port`, ...) are
    built from it. The rollout workers run the agent once per episode against a session of the
    recording OpenAI-compatible proxy; `data.task` still provides the prompts (and the warm-up's
    demonstrations). From Python, `function` and `verifier` may be the functions themselves."""

    command: list[str] | None = Field(None, description="the agent's command, started once per episode with "
                                      "OPENAI_BASE_URL / OPENAI_API_KEY set to its session")
    function: str | AgentFn | None = Field(None, description="or 'module:fn' / 'file.py:fn' called as fn(base_url, "
                                           "api_key, prompt) in a thread, once per episode")
    prompt_via: Literal["stdin", "argument"] = "stdin"
    timeout_s: float = Field(120.0, gt=0, description="per episode; past it the agent is killed, the episode failed")
    max_concurrent: int = Field(16, ge=1, description="agent processes running at once")
    verifier: str | Verifier | None = Field(None, description="'module:fn' scoring a finished path: fn(prompt, "
                                            "messages) -> float; default: the rewards the agent posts to "
                                            "/sessions/{id}/reward")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the agent process")
    model_name: str = Field("axrl-policy", description="the model id the proxy serves (GET /v1/models)")
    host: str = Field("127.0.0.1", description="the proxy's bind address")
    port: int = Field(0, ge=0, le=65535, description="the proxy's port (0: a free one)")
    allow_remote: bool = Field(False, description="allow a non-loopback `host` (the proxy serves the policy)")
    render_tools: bool = Field(True, description="render the request's `tools` into the prompt (false: only "
                               "parse tool calls, for a policy that learnt its tools without the schema)")
    # `python script.py` agents are forked from one interpreter that imported the script's
    # modules once (axrl.agents.forkserver): ~1 s of imports saved per episode.
    fork_server: bool = Field(True, description="fork `python script.py` agents from one interpreter that "
                              "imported the script's modules once (false: a fresh process per episode)")
    coalesce_ms: float = Field(0.0, ge=0, description="hold the proxy's model calls until none joined for this "
                               "long, then submit them together (0: off; docs/agents.md, \"What the proxy costs\")")

    @model_validator(mode="after")
    def _one_agent(self) -> "AgentSettings":
        if (self.command is None) == (self.function is None):
            raise ValueError("agent: set exactly one of `command` (a list: [program, args...]) and `function`")
        if self.command is not None and not self.command:
            raise ValueError("agent.command: an empty command; give [program, args...]")
        return self


def prompt_text(prompt: Prompt) -> str:
    """What the agent is given: the prompt's text (a chat prompt: its last user message)."""
    if prompt.text is not None:
        return prompt.text
    users = [m for m in prompt.as_messages() if m.get("role") == "user"]
    return str((users or prompt.as_messages())[-1].get("content", ""))


class AgentSlots:
    """At most `limit` agents at once over every event loop (the rollout worker's and the
    evaluator's run concurrently, each in its own thread): an `asyncio.Semaphore` belongs to one
    loop, and one per loop would let each loop start `limit` agents."""

    def __init__(self, limit: int) -> None:
        self.limit, self.running = limit, 0
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.running < self.limit:
                self.running += 1
                return
            waiter = loop.create_future()
            self._waiters.append((loop, waiter))
        try:
            await waiter  # a releasing agent hands its slot over
        except asyncio.CancelledError:
            with self._lock:
                if (loop, waiter) in self._waiters:
                    self._waiters.remove((loop, waiter))
                    raise
            if not waiter.cancelled():  # handed over before the cancel landed: pass the slot on
                self._release()
            raise  # (else `_hand_over` sees the cancelled waiter and passes it on)

    async def __aexit__(self, *_exc: Any) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            if not self._waiters:
                self.running -= 1
                return
            loop, waiter = self._waiters.popleft()
        loop.call_soon_threadsafe(_hand_over, waiter, self)


def _hand_over(waiter: asyncio.Future, slots: AgentSlots) -> None:
    if waiter.cancelled():  # its task was cancelled after the hand-over was scheduled
        slots._release()
    else:
        waiter.set_result(None)


class BlackBoxPlayer:
    """Plays episodes of `agent` through `proxy`; `play` is an `EpisodeRunner` player."""

    def __init__(self, agent: AgentSettings, proxy: ProxyServer, *, max_context_len: int) -> None:
        self.agent, self.proxy, self.max_context_len = agent, proxy, max_context_len
        # 'module:fn' strings are imported here, where the episodes run (ValueError naming the key)
        self.function: AgentFn | None = load_callable(agent.function, "agent.function")
        self.verifier: Verifier | None = load_callable(agent.verifier, "agent.verifier")
        self.slots = AgentSlots(agent.max_concurrent)
        self._fork_servers: dict[str, ForkServer] = {}
        self._fork_lock = threading.Lock()

    def close(self) -> None:
        """Stop the fork servers (they also exit with this process)."""
        with self._fork_lock:
            servers, self._fork_servers = list(self._fork_servers.values()), {}
        for server in servers:
            server.close()

    def _start(self, argv: list[str], env: dict[str, str]) -> Any:
        """The agent's process: forked from the script's fork server when it is a plain
        `python script.py` (see AgentSettings.fork_server), else a fresh `subprocess.Popen`."""
        script = forkable(argv) if self.agent.fork_server else None
        if script is None:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env=env)
        with self._fork_lock:
            server = self._fork_servers.get(script)
            if server is None:
                server = self._fork_servers[script] = ForkServer(script)
        return server.spawn(argv[1:], env)

    async def play(self, engine: InferenceEngine, *, sample_id: int, group_id: int, prompt: Prompt,
                   sampling: SamplingParams, return_routing: bool) -> Trajectory:
        loop = asyncio.get_running_loop()

        def submit(request: Any) -> Any:  # called from the proxy's thread: run on this loop
            return asyncio.run_coroutine_threadsafe(engine.generate(request), loop)

        submit.engine = engine  # type: ignore[attr-defined] # streamed calls follow its tokens (`progress`)

        policy = SessionPolicy(sampling=sampling, honour_sampling=False, max_tokens=sampling.max_new_tokens,
                               seed=sampling.seed, render_tools=self.agent.render_tools)
        session = self.proxy.open_session(submit, policy, max_context_len=self.max_context_len,
                                          session_id=f"s{sample_id}-{os.urandom(4).hex()}",
                                          meta={"routing": return_routing})
        started = time.monotonic()
        try:
            async with self.slots:
                outcome = await self._run(session, prompt_text(prompt))
        finally:
            self.proxy.close_session(session)
        if session.state == "open":
            session.end(failed=outcome["error"] is not None, error=outcome["error"] or "")
        trajectories = self._trajectories(session, sample_id, group_id, prompt)
        for t in trajectories:
            t.info.update(agent_exit_code=outcome["exit_code"], agent_seconds=round(time.monotonic() - started, 3),
                          session_events=[dataclasses.asdict(e) for e in session.events])
            if outcome.get("columns") and t.status != "failed":
                t.info["columns"] = dict(outcome["columns"])   # recorded as /samples/<name>
        primary, *forks = trajectories
        primary.forks = forks
        return primary

    async def _run(self, session: Session, text: str) -> dict[str, Any]:
        """Run the agent to its end; {"exit_code", "error" (None: success), "stderr"}."""
        base_url = self.proxy.base_url(session)
        if self.function is not None:
            try:
                value = await asyncio.wait_for(asyncio.to_thread(self.function, base_url, session.api_key, text),
                                               self.agent.timeout_s)
            except asyncio.TimeoutError:
                return {"exit_code": None, "error": f"timeout: the agent ran past agent.timeout_s="
                                                    f"{self.agent.timeout_s:g} s", "stderr": ""}
            except Exception as e:  # noqa: BLE001 — the agent's failure is the episode's outcome
                return {"exit_code": None, "error": f"agent raised {type(e).__name__}: {e}", "stderr": ""}
            try:
                return {"exit_code": 0, "error": None, "stderr": "", "columns": returned_columns(value)}
            except ValueError as e:
                return {"exit_code": None, "error": str(e), "stderr": ""}
        env = {**os.environ, **self.agent.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": session.api_key,
               "OPENAI_MODEL": self.proxy.registry.model_name, "AXRL_SESSION_ID": session.id,
               # Anthropic's SDK appends /v1/messages itself: its base URL is the session's root
               "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": session.api_key,
               "ANTHROPIC_MODEL": self.proxy.registry.model_name}
        argv = agent_argv(self.agent.command or []) + ([text] if self.agent.prompt_via == "argument" else [])
        try:
            proc = await asyncio.to_thread(self._start, argv, env)
        except (OSError, RuntimeError) as e:
            return {"exit_code": None, "error": f"cannot start agent.command {argv[0]!r}: {e}", "stderr": ""}
        stdin = text.encode() if self.agent.prompt_via == "stdin" else b""
        # A blocking wait in a worker thread: asyncio's child watchers belong to the main thread's loop.
        try:
            err, timed_out = await asyncio.to_thread(_communicate, proc, stdin, self.agent.timeout_s)
        except asyncio.CancelledError:
            proc.kill()
            raise
        tail = err.decode(errors="replace")[-STDERR_TAIL_CHARS:]
        if timed_out:
            return {"exit_code": proc.returncode, "stderr": tail,
                    "error": f"timeout: the agent ran past agent.timeout_s={self.agent.timeout_s:g} s and was "
                             f"killed; stderr tail:\n{tail}"}
        if proc.returncode != 0:
            return {"exit_code": proc.returncode, "stderr": tail,
                    "error": f"agent exited with code {proc.returncode}; stderr tail:\n{tail}"}
        return {"exit_code": 0, "error": None, "stderr": tail}

    def _trajectories(self, session: Session, sample_id: int, group_id: int, prompt: Prompt) -> list[Trajectory]:
        verifier = self.verifier

        def score(path: list[Turn]) -> float:
            assert verifier is not None
            value = verifier(prompt, session.conversation(path))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"agent.verifier returned {value!r} for prompt {prompt.prompt_id!r}; "
                                 "it must return a number")
            return float(value)

        error = session.error if session.state == "failed" else ""
        trajectories: list[Trajectory] = []
        if session.turns:
            try:
                trajectories = session.trajectories(sample_id=sample_id, group_id=group_id,
                                                    prompt_id=prompt.prompt_id,
                                                    reward=score if verifier is not None and not error else None)
            except Exception as e:  # noqa: BLE001 — a verifier error fails the episode, not the run
                error = f"agent.verifier raised {type(e).__name__}: {e}"
                trajectories = session.trajectories(sample_id=sample_id, group_id=group_id,
                                                    prompt_id=prompt.prompt_id)
        else:
            error = error or "the agent made no model call"
            traj = Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=prompt.prompt_id)
            ids = session.tokenizer.apply_chat_template(prompt.as_messages(), add_generation_prompt=True)
            traj.append(list(ids)[: self.max_context_len], generated=False, turn=0)
            traj.prompt_len, traj.session_id = traj.num_tokens, session.id
            trajectories = [traj]
        for t in trajectories:
            t.info["session"] = session.id
            if error:
                t.status, t.finish_reason, t.error, t.reward = "failed", "failed", error, 0.0
                t.turn_rewards = []   # a failed episode is scored 0, per turn too
        return trajectories


def returned_columns(value: Any) -> dict[str, float]:
    """The per-sample numbers an `agent.function` returned as `{"columns": {name: number}}` (any
    other return value: none). Names are namespaced (`reward.correct`, `metric.turns`: a dot, and
    letters, digits, `_`, `.`, `-`), so they never collide with the trace's own sample columns."""
    if not isinstance(value, dict) or "columns" not in value:
        return {}
    columns = value["columns"]
    if not isinstance(columns, dict):
        raise ValueError(f"agent.function returned columns={columns!r}: expected a dict of name -> number")
    out: dict[str, float] = {}
    for name, v in columns.items():
        if not isinstance(name, str) or "." not in name or not _COLUMN_NAME.match(name):
            raise ValueError(f"agent.function returned the column name {name!r}: names are namespaced "
                             "('reward.correct'; letters, digits, '_', '.', '-', with a dot)")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"agent.function returned column {name!r} = {v!r}: expected a number")
        out[name] = float(v)
    return out


def agent_argv(command: list[str]) -> list[str]:
    """The command to start: a leading "python" / "python3" is this interpreter (the agent then
    finds the packages of AxRL's environment, e.g. `openai`)."""
    argv = list(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def _communicate(proc: subprocess.Popen, stdin: bytes, timeout: float) -> tuple[bytes, bool]:
    """(stderr, timed out): wait for the agent; past `timeout` kill it."""
    try:
        _, err = proc.communicate(stdin, timeout=timeout)
        return err or b"", False
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return err or b"", True


def load_callable(spec: str | Callable[..., Any] | None, key: str) -> Callable[..., Any] | None:
    """`agent.verifier` / `agent.function` ("module:fn" / "file.py:fn") → the function (None: unset;
    a function given from Python is returned as it is)."""
    if not spec:
        return None
    if callable(spec):
        return spec
    from axrl.agents.tasks.resolve import load_object

    fn = load_object(spec, key)
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r} is not callable")
    return fn

