"""A minimal HTTP/1.1 server for ASGI apps: what the proxy serves its agents' calls with.

Why not uvicorn: on the proxy's hot path (small JSON requests over keep-alive connections from
local agents) uvicorn's pure-Python h11 protocol costs ~0.3 ms of CPU per call on top of a plain
`asyncio.Protocol` (`bench/proxy_overhead.py`, docs/agents.md "What the proxy costs"), and that
CPU is taken from the engine's process. This server parses the request line and headers with
`bytes` operations, hands the app one `http.request` message, and writes a reply's head and body
in one `write` (an unstreamed reply) or as chunked transfer coding (a streamed one, SSE).

What it supports is what agents send: HTTP/1.0 and 1.1, keep-alive (requests of one connection
served in order), bodies with `Content-Length` (a chunked request body is a 411), `Expect:
100-continue`, `HEAD`. `receive()` after the body waits for the client to go away
(`http.disconnect`), as Starlette's streaming responses expect.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any
from urllib.parse import unquote

from starlette.types import ASGIApp

log = logging.getLogger("axrl.proxy")
MAX_HEAD = 64 * 1024            # request line + headers
MAX_BODY = 256 * 1024 * 1024    # a conversation of a long-context agent fits many times
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 409: "Conflict",
            411: "Length Required", 413: "Content Too Large", 422: "Unprocessable Content",
            429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


class HttpServer:
    """Serves `app` on a bound socket from the running event loop: `await serve(sock)`; `stop()`
    from any thread. `started` is set once it listens."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.connections: set[_Connection] = set()

    async def serve(self, sock: socket.socket) -> None:
        """Listen on `sock` until `stop()`; then close every connection and cancel what runs."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        sock.listen(1024)
        server = await self._loop.create_server(lambda: _Connection(self), sock=sock)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            server.close()
            for conn in list(self.connections):
                conn.shutdown()
            await server.wait_closed()

    def stop(self) -> None:
        """Ask the server to stop (thread-safe)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)


class _Connection(asyncio.Protocol):
    """One client connection: its requests are parsed from `buffer` and served one at a time."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None       # the request being served
        self.gone: asyncio.Event | None = None      # set when the client disconnects
        self.peer: Any = None
        self.local: Any = None

    # -- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer, self.local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        self.gone = asyncio.Event()
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        assert self.gone is not None
        self.gone.set()

    def shutdown(self) -> None:
        """Close the connection, cancelling the request it serves (the server stops)."""
        if self.task is not None:
            self.task.cancel()
        if self.transport is not None:
            self.transport.close()

    # -- requests ------------------------------------------------------------------------------------
    def _next(self) -> None:
        """Start serving the next complete request in `buffer`, if there is one."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                self._refuse(431, "request headers too large")
            return
        try:
            method, target, version, headers = _parse_head(bytes(self.buffer[:end]))
        except ValueError as e:
            return self._refuse(400, str(e))
        fields = dict(headers)
        if b"transfer-encoding" in fields:
            return self._refuse(411, "chunked request bodies are not supported: send Content-Length")
        try:
            length = int(fields.get(b"content-length", b"0"))
        except ValueError:
            return self._refuse(400, "Content-Length is not a number")
        if length < 0 or length > MAX_BODY:
            return self._refuse(413, f"the body must be 0 to {MAX_BODY} bytes")
        start = end + 4
        if len(self.buffer) < start + length:
            if fields.get(b"expect", b"").lower() == b"100-continue" and len(self.buffer) == start:
                assert self.transport is not None
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return
        body = bytes(self.buffer[start:start + length])
        del self.buffer[:start + length]
        keep = (fields.get(b"connection", b"").lower() != b"close" if version == b"HTTP/1.1"
                else fields.get(b"connection", b"").lower() == b"keep-alive")
        path, _, query = target.partition(b"?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": version[5:].decode(), "method": method.decode("latin-1"), "scheme": "http",
                 "path": unquote(path.decode("latin-1")), "raw_path": path, "query_string": query,
                 "root_path": "", "headers": headers, "client": self.peer, "server": self.local}
        self.task = asyncio.get_running_loop().create_task(_Exchange(self, scope, body, keep).run())

    def done(self, keep: bool) -> None:
        """The request finished: serve the next one, or close."""
        self.task = None
        if self.transport is None or self.transport.is_closing():
            return
        if not keep:
            self.transport.close()
        elif self.buffer:
            self._next()

    def _refuse(self, status: int, detail: str) -> None:
        """Answer a request that cannot be parsed, and close."""
        body = detail.encode()
        assert self.transport is not None
        self.transport.write(_head(status, [(b"content-type", b"text/plain; charset=utf-8"),
                                            (b"content-length", str(len(body)).encode()),
                                            (b"connection", b"close")]) + body)
        self.transport.close()


def _parse_head(head: bytes) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]:
    """(method, target, version, headers with lower-case names) of a request head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].startswith(b"/"):
        raise ValueError(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed header line: {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    return parts[0], parts[1], parts[2], headers


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, "").encode())]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Exchange:
    """One request/response: the ASGI `receive` and `send` of one app call."""

    def __init__(self, conn: _Connection, scope: dict[str, Any], body: bytes, keep: bool) -> None:
        self.conn, self.scope, self.body, self.keep = conn, scope, body, keep
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = self.chunked = self.complete = False

    async def run(self) -> None:
        try:
            await self.conn.server.app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            self.keep = False
            raise
        except Exception:  # noqa: BLE001 — logged, and the client gets a 500, never a traceback
            log.exception("the agent proxy failed serving %s %s", self.scope["method"], self.scope["path"])
            if not self.started and not self._gone():
                await self.send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
                await self.send({"type": "http.response.body", "body": b"Internal Server Error"})
            self.keep = False
        finally:
            if not self.complete:
                self.keep = False
            self.conn.done(self.keep)

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        assert self.conn.gone is not None
        await self.conn.gone.wait()
        return {"type": "http.disconnect"}

    def _gone(self) -> bool:
        return self.conn.transport is None or self.conn.transport.is_closing()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started, self.status = True, int(message["status"])
            self.headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.complete:
            raise RuntimeError("http.response.body outside a response")
        body, more = bytes(message.get("body", b"")), bool(message.get("more_body", False))
        self.complete = not more
        if self._gone():
            return
        transport = self.conn.transport
        assert transport is not None and self.status is not None
        head_only = self.scope["method"] == "HEAD"
        if self.headers is not None:  # the first body message: the head goes with it
            names = {k for k, _ in self.headers}
            headers = self.headers + ([] if self.keep else [(b"connection", b"close")])
            if b"content-length" not in names:
                if more:
                    self.chunked = True
                    headers.append((b"transfer-encoding", b"chunked"))
                else:
                    headers.append((b"content-length", str(len(body)).encode()))
            self.headers = None  # type: ignore[assignment]
            out = _head(self.status, headers)
        else:
            out = b""
        if not head_only:
            if self.chunked:
                out += (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
            else:
                out += body
        if out:
            transport.write(out)
