"""The proxy's HTTP routes: per-session OpenAI base URLs, rewards, session end.

    GET  /sessions/{id}/v1/models
    POST /sessions/{id}/v1/chat/completions     (tools, stream, n, stop, max_tokens, temperature, top_p)
    POST /sessions/{id}/v1/completions
    POST /sessions/{id}/reward                  {"reward": float, "turn": int (optional: per-turn)}
    POST /sessions/{id}/end                     {"failed": bool, "error": str} (both optional)
    POST /v1/trajectories                       token-level trajectories (axrl.agents.proxy.service)
    GET  /sessions/{id}                         the session's turns, forks and drift (debugging)
    GET  /health

Every `/sessions/{id}/…` route checks `Authorization: Bearer <the session's key>` (401), an
unknown session is a 404, a malformed request a 400 naming the field, a call to an ended session
a 409 — all as OpenAI error objects, never a traceback, and an error never ends the session.
While the registry's admission gate refuses new calls (the staleness bound) a call gets 429 with
`Retry-After`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from axrl.agents.proxy import openai_api
from axrl.agents.proxy.openai_api import ProxyError, SessionPolicy
from axrl.agents.proxy.service import AgentService
from axrl.agents.proxy.session import Session, SessionError
from axrl.inference.http_body import parse_json_body


class SessionRegistry:
    """The live sessions of a proxy, with each one's policy; thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._sessions: dict[str, tuple[Session, SessionPolicy]] = {}
        self._lock = threading.Lock()
        # None: admit; a number: refuse the call, retry after that many seconds (HTTP 429).
        self.gate: Callable[[Session], float | None] = lambda _s: None
        self.service: AgentService | None = None   # POST /v1/trajectories (agents with their own engine)

    def add(self, session: Session, policy: SessionPolicy) -> None:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id!r} exists")
            self._sessions[session.id] = (session, policy)

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def get(self, session_id: str) -> tuple[Session, SessionPolicy] | None:
        with self._lock:
            return self._sessions.get(session_id)

    def items(self) -> list[tuple[Session, SessionPolicy]]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


def _error(e: ProxyError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(e.retry_after)))} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(registry: SessionRegistry) -> FastAPI:
    app = FastAPI(title="axrl agent proxy")

    @app.exception_handler(ProxyError)
    async def proxy_error(_request: Request, exc: ProxyError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:  # never a traceback to the agent
        return JSONResponse(ProxyError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)

    async def body_of(request: Request) -> Any:
        try:
            return parse_json_body(await request.body())
        except ValueError as e:
            raise ProxyError(400, str(e)) from None

    def session_of(request: Request, session_id: str, *, calls: bool = False) -> tuple[Session, SessionPolicy]:
        found = registry.get(session_id)
        if found is None:
            raise ProxyError(404, f"no session {session_id!r} (ended and collected, or never created)",
                             code="session_not_found")
        session, policy = found
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {session.api_key}":
            raise ProxyError(401, "Incorrect API key provided for this session: use the session's own key "
                             "(OPENAI_API_KEY of the agent's environment)", code="invalid_api_key")
        if calls and session.state != "open":
            raise ProxyError(409, f"session {session_id!r} has ended ({session.state}); it takes no more calls",
                             code="session_ended")
        if calls:
            wait = registry.gate(session)
            if wait is not None:
                raise ProxyError(429, "the trainer is behind (staleness bound): retry later", retry_after=wait,
                                 code="staleness_bound")
        session.touch()
        return session, policy

    def reply(out: dict[str, Any] | Any) -> Response:
        if isinstance(out, dict):
            return JSONResponse(out)
        return StreamingResponse(out, media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "sessions": len(registry)}

    @app.get("/sessions/{session_id}/v1/models")
    async def models(request: Request, session_id: str) -> dict[str, Any]:
        session_of(request, session_id)
        return {"object": "list", "data": [{"id": registry.model_name, "object": "model", "created": 0,
                                            "owned_by": "axrl"}]}

    @app.get("/sessions/{session_id}/v1/models/{model}")
    async def model(request: Request, session_id: str, model: str) -> dict[str, Any]:
        session_of(request, session_id)
        if model != registry.model_name:
            raise ProxyError(404, f"The model {model!r} does not exist; this proxy serves {registry.model_name!r}",
                             param="model", code="model_not_found")
        return {"id": model, "object": "model", "created": 0, "owned_by": "axrl"}

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat(request: Request, session_id: str) -> Response:
        session, policy = session_of(request, session_id, calls=True)
        return reply(await openai_api.chat(session, policy, await body_of(request), registry.model_name))

    @app.post("/sessions/{session_id}/v1/completions")
    async def completions(request: Request, session_id: str) -> Response:
        session, policy = session_of(request, session_id, calls=True)
        return reply(await openai_api.completion(session, policy, await body_of(request), registry.model_name))

    @app.post("/sessions/{session_id}/reward")
    async def reward(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = session_of(request, session_id)
        body = await body_of(request)
        value, turn = body.get("reward") if isinstance(body, dict) else None, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise openai_api.bad("reward", f"must be a finite number, got {value!r}")
        if body.get("turn") is not None:
            turn = body["turn"]
            if isinstance(turn, bool) or not isinstance(turn, int):
                raise openai_api.bad("turn", f"must be an integer (1 = the session's first call), got {turn!r}")
        try:
            session.set_reward(float(value), turn)
        except SessionError as e:
            raise ProxyError(400, str(e), param="turn") from None
        return {"ok": True, "session": session_id, "turn": turn, "reward": float(value)}

    @app.post("/sessions/{session_id}/end")
    async def end(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = session_of(request, session_id)
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("failed", False), bool):
            raise openai_api.bad("failed", "must be true or false")
        session.end(failed=body.get("failed", False), error=str(body.get("error", "")))
        return {"ok": True, "session": session_id, "state": session.state, "turns": len(session.turns)}

    @app.post("/v1/trajectories")
    async def trajectories(request: Request) -> dict[str, Any]:
        service = registry.service
        if service is None:
            raise ProxyError(404, "this proxy has no agent service (POST /v1/trajectories)", code="no_service")
        if service.api_key is not None and request.headers.get("authorization", "") != f"Bearer {service.api_key}":
            raise ProxyError(401, "Incorrect API key provided for the agent service", code="invalid_api_key")
        traj = service.push(await body_of(request))
        return {"ok": True, "sample_id": traj.sample_id, "group_id": traj.group_id,
                "tokens": traj.num_tokens, "trained_tokens": traj.num_generated}

    @app.get("/sessions/{session_id}")
    async def show(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = session_of(request, session_id)
        return {"id": session.id, "state": session.state, "turns": [
            {"index": t.index, "parent": t.parent, "prompt_tokens": len(t.prompt_ids),
             "completion_tokens": len(t.output_ids), "drift_tokens": t.drift_tokens, "reward": t.reward}
            for t in session.turns.values()], "events": [vars(e) for e in session.events],
            "final_reward": session.final_reward}

    return app
