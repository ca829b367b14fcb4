"""The proxy's Anthropic Messages and OpenAI Responses endpoints of a session.

    POST /sessions/{id}/v1/messages      (Anthropic's SDK: base_url = …/sessions/{id})
    POST /sessions/{id}/v1/responses     (OpenAI's SDK: base_url = …/sessions/{id}/v1)

Each request is translated into a chat-completions call (`axrl.inference.openai.anthropic_messages`,
`.responses`) and run by the session's own `chat` handler: the same stitching, generation and
token-level recording as `/v1/chat/completions`, so a tool round trip through either API extends
the session as a chat agent's would; `stream: true` streams the chat call and translates its
chunks as the tokens arrive. Auth is the session key, as `Authorization: Bearer <key>` or
(Anthropic's SDK) `x-api-key: <key>`. Errors are each API's own error object.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from axrl.agents.proxy.openai_routes import Reply, chat
from axrl.agents.proxy.registry import SessionPolicy, SessionRegistry
from axrl.agents.proxy.session import Session
from axrl.inference.openai import anthropic_messages
from axrl.inference.openai.errors import ApiError, openai_error_body
from axrl.inference.openai.http import error_response, json_body, json_or_sse
from axrl.inference.openai.responses import create_response

ErrorBody = Callable[[ApiError], dict[str, Any]]


async def messages(session: Session, policy: SessionPolicy, body: Any, model: str) -> Reply:
    """`POST /v1/messages` in a session."""
    async def run(request: dict[str, Any]) -> Reply:
        return await chat(session, policy, request, model)  # streamed when the call is

    return await anthropic_messages.create_message(body, run, model)


async def responses(session: Session, policy: SessionPolicy, body: Any, model: str) -> Reply:
    """`POST /v1/responses` in a session."""
    async def run(request: dict[str, Any]) -> Reply:
        return await chat(session, policy, request, model)  # streamed when the call is

    return await create_response(body, run, model)


# Suffix of the session URL, handler, error body: the routes `add_api_routes` and `CallRoutes` serve.
API_CALLS: tuple[tuple[str, Any, ErrorBody], ...] = (
    ("/v1/messages", messages, anthropic_messages.error_body),
    ("/v1/responses", responses, openai_error_body))


def credentials(authorization: str | None, api_key: str | None) -> str:
    """The `Authorization` value a request's session key is checked against: the header itself,
    else Anthropic's `x-api-key` as a bearer token."""
    return authorization or (f"Bearer {api_key}" if api_key else "")


def add_api_routes(app: FastAPI, registry: SessionRegistry) -> None:
    """The Messages and Responses routes of record on `app` (each answering its own error shape)."""
    for suffix, handler, error_body in API_CALLS:
        _add_route(app, registry, suffix, handler, error_body)


def _add_route(app: FastAPI, registry: SessionRegistry, suffix: str, handler: Any, error_body: ErrorBody) -> None:
    @app.post("/sessions/{session_id}" + suffix, name=suffix)
    async def route(request: Request, session_id: str) -> Response:
        try:
            auth = credentials(request.headers.get("authorization"), request.headers.get("x-api-key"))
            session, policy = registry.authorize(session_id, auth, calls=True)
            return json_or_sse(await handler(session, policy, await json_body(request), registry.model_name))
        except ApiError as e:
            return error_response(e, error_body)
