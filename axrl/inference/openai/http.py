"""FastAPI glue of the OpenAI-compatible servers: JSON bodies, JSON-or-SSE replies, the
handler that turns an `ApiError` into its error body, and `OneSendH11Protocol` (uvicorn's h11
protocol sending a reply's head and body in one write)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from axrl.inference.openai.errors import ApiError


async def json_body(request: Request) -> Any:
    """The request's body as JSON, ``{}`` when it is empty; a 400 saying why it is not JSON."""
    return parse_json(await request.body())


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, ``{}`` when it is empty; a 400 saying why it is not JSON."""
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


class _CoalescingTransport:
    """A transport whose writes of one event-loop step leave in one `send`.

    uvicorn writes a reply's status line + headers, its body and (chunked) its end separately;
    with TCP_NODELAY each write is a segment of its own and the client wakes up (and, threaded,
    takes its GIL back) once per segment. Here the writes of one step are joined and sent when
    the step yields (`call_soon`); `close` sends what is pending first. Everything else is the
    wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for data in chunks:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneSendH11Protocol(H11Protocol):
    """uvicorn's h11 protocol (`uvicorn.Config(http=OneSendH11Protocol)`), its writes of one
    event-loop step joined: a JSON reply's head and body leave in one segment."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
