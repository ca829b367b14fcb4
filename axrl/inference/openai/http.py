"""FastAPI glue of the OpenAI-compatible servers: JSON bodies, JSON-or-SSE replies, and the
handler that turns an `ApiError` into its error body."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from axrl.inference.openai.errors import ApiError


async def json_body(request: Request) -> Any:
    """The request's body as JSON, ``{}`` when it is empty; a 400 saying why it is not JSON."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def json_or_sse(reply: dict[str, Any] | AsyncIterator[bytes]) -> Response:
    """A reply object as JSON, a chunk stream as `text/event-stream`."""
    if isinstance(reply, dict):
        return JSONResponse(reply)
    return StreamingResponse(reply, media_type="text/event-stream")


def error_response(error: ApiError, body: Callable[[ApiError], dict[str, Any]]) -> JSONResponse:
    """`error` as its status, `body(error)` and its headers (Retry-After)."""
    return JSONResponse(body(error), status_code=error.status, headers=error.headers)


def handle_api_errors(app: FastAPI, body: Callable[[ApiError], dict[str, Any]]) -> None:
    """Answer every `ApiError` raised by `app`'s routes with `body(error)` (the server's dialect)."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, body)
