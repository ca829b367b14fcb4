"""ProxyServer: the recording OpenAI-compatible proxy, served from a background thread.

    proxy = ProxyServer(tokenizer, model_name="policy").start()        # 127.0.0.1, a free port
    session = proxy.open_session(submit, policy, max_context_len=2048)
    # the agent: OpenAI(base_url=proxy.base_url(session), api_key=session.api_key)
    ...
    session.ended.wait(); trajectories = session.trajectories(...); proxy.close_session(session)

`submit(request) -> concurrent.futures.Future[GenerateResult]` is how a session reaches its
engine: `engine.submit_many([r])[0]` for a plain InferenceEngine, or a coroutine scheduled on the
rollout worker's loop (so the runtime's clock and partial-rollout handling see the call like any
white-box episode's). Calls of any sessions that arrive within `coalesce_window_s` of each
other are submitted together (`axrl.agents.proxy.coalesce`; 0, the default, turns it off). Binding anything
but a loopback address needs `allow_remote=True`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
import uuid
from typing import Any, Callable

from axrl.agents.proxy.call_routes import CallRoutes
from axrl.agents.proxy.proxy_app import create_app
from axrl.agents.proxy.coalesce import CallCoalescer
from axrl.agents.proxy.http_server import HttpServer
from axrl.agents.proxy.registry import SessionPolicy, SessionRegistry
from axrl.agents.proxy.session import Session
from axrl.inference.protocol import GenerateRequest, InferenceEngine
from axrl.tokenizer import Tokenizer

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class engine_submit:  # noqa: N801 — used as a function: `open_session(engine_submit(engine), ...)`
    """A session's `submit` straight onto an engine; `many` lets the call coalescer submit the
    calls of several sessions that arrived together in one `submit_many` (admitted together);
    `engine` lets a streamed call follow its request's tokens (`token_stream.follow`)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine, self.many = engine, engine.submit_many

    def __call__(self, request: GenerateRequest) -> concurrent.futures.Future:
        return self.many([request])[0]


class ProxyServer:
    def __init__(self, tokenizer: Tokenizer, *, model_name: str = "axrl-policy", host: str = "127.0.0.1",
                 port: int = 0, allow_remote: bool = False, idle_timeout_s: float | None = None,
                 coalesce_window_s: float = 0.0, coalesce_max_wait_s: float = 0.05) -> None:
        if host not in _LOOPBACK and not allow_remote:
            raise ValueError(f"agent.proxy_host={host!r} is not a loopback address: the proxy serves the policy "
                             "to anyone who can reach it; pass allow_remote (agent.allow_remote: true) to bind it")
        self.tokenizer, self.host, self.port = tokenizer, host, port
        self.registry = SessionRegistry(model_name)
        self.idle_timeout_s = idle_timeout_s
        # Calls arriving within coalesce_window_s of each other reach the engine as one
        # submission (axrl.agents.proxy.coalesce); off by default: measured no faster on the
        # bench (docs/agents.md, "What the proxy costs"), and a lone call waits the window.
        self.coalescer = CallCoalescer(coalesce_window_s, max(coalesce_max_wait_s, coalesce_window_s))
        self._server: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "ProxyServer":
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without, Nagle + the client's delayed ACK add ~40 ms per call.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # The model calls skip FastAPI's stack (CallRoutes), and HTTP is parsed by a minimal
        # server (http_server: ~0.3 ms of CPU a call less than uvicorn's h11 protocol).
        self._server = server = HttpServer(CallRoutes(create_app(self.registry), self.registry))
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve(sock)), name="axrl-proxy",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the agent proxy did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        if self.idle_timeout_s:
            self._reaper = threading.Thread(target=self._reap, name="axrl-proxy-reaper", daemon=True)
            self._reaper.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.coalescer.close()

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *_exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def cpu_seconds(self) -> float:
        """CPU time the server's thread (the event loop that parses, stitches, records and replies
        for every session) has used so far: what the proxy costs the process it runs in."""
        if self._thread is None or self._thread.ident is None:
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of `session` (what the agent's client is given)."""
        return f"{self.url}/sessions/{session.id}/v1"

    # -- sessions ----------------------------------------------------------------------------------
    def open_session(self, submit: Callable[..., Any], policy: SessionPolicy, *, max_context_len: int,
                     session_id: str | None = None, meta: dict[str, Any] | None = None) -> Session:
        session = Session(session_id or uuid.uuid4().hex[:16], self.tokenizer, max_context_len=max_context_len,
                          submit=self.coalescer.wrap(submit), meta=meta)
        self.registry.add(session, policy)
        return session

    def close_session(self, session: Session) -> None:
        """Forget a session (its URL then answers 404)."""
        self.registry.remove(session.id)

    def _reap(self) -> None:
        """End sessions idle past `idle_timeout_s` as failed: a session never ended must not hang."""
        assert self.idle_timeout_s is not None
        while not self._stop.wait(min(1.0, self.idle_timeout_s / 4)):
            now = time.monotonic()
            for session, _ in self.registry.items():
                if session.state == "open" and now - session.last_activity > self.idle_timeout_s:
                    session.end(failed=True, error=f"timeout: no call or end within {self.idle_timeout_s:g} s")
