"""The proxy's HTTP app: per-session OpenAI base URLs, rewards, session end, the agent service.

    GET  /sessions/{id}/v1/models                (axrl.agents.proxy.openai_routes)
    POST /sessions/{id}/v1/chat/completions
    POST /sessions/{id}/v1/completions
    POST /sessions/{id}/v1/messages              Anthropic Messages (axrl.agents.proxy.api_routes)
    POST /sessions/{id}/v1/responses             OpenAI Responses
    POST /sessions/{id}/reward                  {"reward": float, "turn": int (optional: per-turn)}
    POST /sessions/{id}/end                     {"failed": bool, "error": str} (both optional)
    GET  /sessions/{id}                         the session's turns, forks and drift (debugging)
    POST /v1/trajectories                       token-level trajectories (axrl.agents.proxy.trajectories; the
                                                run's agent key: the service's or a live session's)
    GET  /health

Every `/sessions/{id}/…` route checks `Authorization: Bearer <the session's key>` (401; on the
model calls `x-api-key: <key>` too, as Anthropic's SDK sends it), an unknown session is a 404, a
malformed request a 400 naming the field, a call to an ended session a 409 — all as OpenAI error
objects (Anthropic's on `/v1/messages`), never a traceback, and an error never ends the session.
While the registry's admission gate refuses new calls (the staleness bound) a call gets 429 with
`Retry-After`.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from axrl.agents.proxy.api_routes import add_api_routes
from axrl.agents.proxy.openai_routes import add_openai_routes
from axrl.agents.proxy.registry import SessionRegistry
from axrl.agents.proxy.session import SessionError
from axrl.inference.openai.errors import ApiError, bad, openai_error_body
from axrl.inference.openai.http import handle_api_errors, json_body


def create_app(registry: SessionRegistry) -> FastAPI:
    """The FastAPI app serving `registry`'s sessions."""
    app = FastAPI(title="axrl agent proxy")
    handle_api_errors(app, openai_error_body)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:  # never a traceback to the agent
        return JSONResponse(openai_error_body(ApiError(500, f"{type(exc).__name__}: {exc}")), status_code=500)

    add_openai_routes(app, registry)
    add_api_routes(app, registry)
    _add_session_routes(app, registry)
    _add_service_routes(app, registry)
    return app


def _add_session_routes(app: FastAPI, registry: SessionRegistry) -> None:
    """What an agent (or its runner) says about a session besides model calls: rewards, its end."""

    @app.post("/sessions/{session_id}/reward")
    async def reward(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = registry.authorize(session_id, request.headers.get("authorization", ""))
        body = await json_body(request)
        value, turn = body.get("reward") if isinstance(body, dict) else None, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("reward", f"must be a finite number, got {value!r}")
        if body.get("turn") is not None:
            turn = body["turn"]
            if isinstance(turn, bool) or not isinstance(turn, int):
                raise bad("turn", f"must be an integer (1 = the session's first call), got {turn!r}")
        try:
            session.set_reward(float(value), turn)
        except SessionError as e:
            raise ApiError(400, str(e), param="turn") from None
        return {"ok": True, "session": session_id, "turn": turn, "reward": float(value)}

    @app.post("/sessions/{session_id}/end")
    async def end(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = registry.authorize(session_id, request.headers.get("authorization", ""))
        body = await json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("failed", False), bool):
            raise bad("failed", "must be true or false")
        session.end(failed=body.get("failed", False), error=str(body.get("error", "")))
        return {"ok": True, "session": session_id, "state": session.state, "turns": len(session.turns)}

    @app.get("/sessions/{session_id}")
    async def show(request: Request, session_id: str) -> dict[str, Any]:
        session, _ = registry.authorize(session_id, request.headers.get("authorization", ""))
        return {"id": session.id, "state": session.state, "turns": [
            {"index": t.index, "parent": t.parent, "prompt_tokens": len(t.prompt_ids),
             "completion_tokens": len(t.output_ids), "drift_tokens": session.drift(t).tokens,
             "drift_spans": [list(span) for span in session.drift(t).spans], "fork_cause": t.fork_cause,
             "reward": t.reward}
            for t in session.turns.values()], "events": [vars(e) for e in session.events],
            "final_reward": session.final_reward}


def _add_service_routes(app: FastAPI, registry: SessionRegistry) -> None:
    """The proxy's own health, and the agent service's trajectory intake."""

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "sessions": len(registry)}

    @app.post("/v1/trajectories")
    async def trajectories(request: Request) -> dict[str, Any]:
        service = registry.service
        if service is None:
            raise ApiError(404, "this proxy has no agent service (POST /v1/trajectories)", code="no_service")
        registry.authorize_agent(request.headers.get("authorization", ""))
        traj = service.push(await json_body(request))
        return {"ok": True, "sample_id": traj.sample_id, "group_id": traj.group_id,
                "tokens": traj.num_tokens, "trained_tokens": traj.num_generated}
