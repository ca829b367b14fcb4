"""The proxy's fast path for model calls: `CallRoutes`, an ASGI app in front of the FastAPI app."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from axrl.agents.proxy.api_routes import API_CALLS, credentials
from axrl.agents.proxy.openai_routes import chat, completion
from axrl.agents.proxy.registry import SessionRegistry
from axrl.inference.openai.errors import ApiError, openai_error_body
from axrl.inference.openai.http import error_response, json_or_sse, parse_json

# Suffix of the session URL, handler, error body (chat before completions: a longer suffix first).
_CALLS = (("/v1/chat/completions", chat, openai_error_body), ("/v1/completions", completion, openai_error_body),
          *API_CALLS)


class CallRoutes:
    """ASGI: `POST /sessions/{id}/v1/chat/completions`, `/v1/completions`, `/v1/messages` and
    `/v1/responses` answered straight by their handlers, every other request passed to `app` (the
    FastAPI app, which has the same routes). The reply is the route's, byte for byte: the same
    authorization, body parsing, handlers and error bodies — without FastAPI's middleware stack,
    router and dependency solving (~0.15 ms of the proxy's ~0.5 ms of Python per call, in the
    engine's process)."""

    def __init__(self, app: ASGIApp, registry: SessionRegistry) -> None:
        self.app, self.registry = app, registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            path = scope["path"]
            if path.startswith("/sessions/"):
                for suffix, handler, error_body in _CALLS:
                    if path.endswith(suffix):
                        session_id = path[len("/sessions/"):-len(suffix)]
                        if session_id and "/" not in session_id:
                            return await self._call(handler, error_body, session_id, scope, receive, send)
                        break
        await self.app(scope, receive, send)

    async def _call(self, handler: Any, error_body: Any, session_id: str, scope: Scope, receive: Receive,
                    send: Send) -> None:
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"authorization", b"x-api-key")}
        try:
            auth = credentials(headers.get(b"authorization"), headers.get(b"x-api-key"))
            session, policy = self.registry.authorize(session_id, auth, calls=True)
            body = parse_json(await _read_body(receive))
            response = json_or_sse(await handler(session, policy, body, self.registry.model_name))
        except ApiError as e:
            response = error_response(e, error_body)
        except Exception as e:  # noqa: BLE001 — as the app's handler: a 500 body, never a traceback to the agent
            await JSONResponse(openai_error_body(ApiError(500, f"{type(e).__name__}: {e}")),
                               status_code=500)(scope, receive, send)
            raise  # ... and, as Starlette's ServerErrorMiddleware, logged by the server
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> bytes:
    """The request body (Starlette's `Request.body`: a disconnect raises `ClientDisconnect`)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            if message.get("body"):
                chunks.append(message["body"])
            if not message.get("more_body", False):
                return b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
