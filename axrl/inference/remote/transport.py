"""Blocking HTTP calls from a server client (SGLang's, vLLM's) to its servers, with retries and
back-off, and the errors they raise. The generation path (async, batched) has its own retry loop
in `axrl/inference/sglang/client.py` because it also re-routes and re-sends requests; both share
`backoff_delay` and `error_message`.

A 4xx answer is the request's fault and raises ValueError at once with the server's message;
connection errors, timeouts and 5xx are retried (restarting a dead server first when a launcher
owns it) and end in `ServerUnavailable`.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Sequence

import httpx

from axrl.inference.remote.launcher import ServerLauncher


class ServerUnavailable(ConnectionError):
    """A server could not be reached (or kept failing) after all retries."""


class Retryable(Exception):
    """A failure worth retrying (5xx)."""


def error_message(resp: httpx.Response) -> str:
    """The server's explanation in an error response (its JSON message, else the text), shortened."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body.get("error") or body)[:1000]
    return str(body)[:1000]


def server_context(launcher: ServerLauncher | None, i: int) -> str:
    """The end of a launched server's output for an error about it (empty without a launcher):
    what the server said when it failed, which its HTTP answer rarely holds."""
    if launcher is None:
        return ""
    try:
        return "\n" + launcher.failure_report(i)
    except (OSError, IndexError):
        return ""


def backoff_delay(backoff_s: float, attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (>= 1): `backoff_s`, doubled each time."""
    return backoff_s * 2 ** (attempt - 1)


def in_daemon_thread(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run `fn` on a daemon thread: a collective stuck on a peer that never joined must not keep
    the process from exiting (the group's timeout ends it eventually)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 — handed to the waiter
            future.set_exception(e)

    threading.Thread(target=run, name="axrl-weight-collective", daemon=True).start()
    return future


class BlockingTransport:
    """Blocking control calls to servers `urls[i]` (callable from any thread).

    Args:
        urls: server base URLs, without a trailing slash.
        timeout: httpx timeout of every call.
        retries, backoff_s: retry count and first back-off delay (doubled on each retry).
        launcher: restarts a dead server before the next attempt (None: just retry).
    """

    def __init__(self, urls: Sequence[str], timeout: httpx.Timeout, retries: int, backoff_s: float,
                 launcher: ServerLauncher | None) -> None:
        self.urls, self.retries, self.backoff_s, self.launcher = list(urls), retries, backoff_s, launcher
        self.client = httpx.Client(timeout=timeout)  # also for best-effort calls without retries

    def control(self, i: int, method: str, path: str, body: Any = None, ok404: bool = False) -> httpx.Response:
        """A blocking call to server i with retries (restarting it via the launcher if it died).
        Raises ServerUnavailable when it stays unreachable, ValueError on a 4xx answer (a 404 is
        returned instead when `ok404`: an endpoint older servers lack)."""
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                threading.Event().wait(backoff_delay(self.backoff_s, attempt))
            try:
                resp = self.client.request(method, self.urls[i] + path, json=body)
            except httpx.TransportError as e:
                error = e
                self._recover(i)
                continue
            if resp.status_code >= 500:
                error = Retryable(f"HTTP {resp.status_code}: {error_message(resp)}")
                continue
            if resp.status_code == 404 and ok404:
                return resp
            if resp.status_code >= 400:
                raise ValueError(f"{self.urls[i]}{path} rejected the request (HTTP {resp.status_code}): "
                                 f"{error_message(resp)}")
            return resp
        raise ServerUnavailable(f"{self.urls[i]}{path} failed after {self.retries + 1} attempts "
                                f"(retries={self.retries}, backoff_s={self.backoff_s}): {type(error).__name__}: {error}"
                                f"{server_context(self.launcher, i)}")

    def _recover(self, i: int) -> None:
        """After a transport error: restart a dead server (launcher only)."""
        if self.launcher is not None:
            try:
                self.launcher.ensure_alive(i)
            except RuntimeError:
                pass  # counted as a failed attempt; the next one tries again

    def post_all(self, path: str, body: Any, ok404: bool = False) -> list[httpx.Response]:
        """POST `body` to every server at once (`control` each); the responses in server order."""
        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self.control, i, "POST", path, body, ok404) for i in range(len(self.urls))]
            return [f.result() for f in futures]

    def close(self) -> None:
        self.client.close()
