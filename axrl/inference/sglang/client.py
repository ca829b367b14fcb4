"""`SGLangEngine`: the `InferenceEngine` protocol over SGLang's HTTP API (or `axrl serve`).

Threads: the client owns one event loop on a background thread, where its `httpx.AsyncClient`
lives; `generate` / `submit_many` hand requests to it and return futures, so callers may use any
event loop (the rollout worker starts a new one each step) or none. Control calls
(`update_weights`, `abort`, `health`) are synchronous and use a separate blocking client.

Routing: requests with the same `sticky_key` (one per episode, set by the agent loop) go to the
same server, chosen by a stable hash of the key, so a trajectory's multi-turn prefix stays in
that server's cache and a run routes the same way every time. Requests without a key go round
robin. `submit_many` (used by rollouts clocked by rounds) sends one batched `/generate` per server,
which `axrl serve` admits at once — as deterministic as the in-process engine.

Failures: connection errors, timeouts and 5xx are retried `retries` times with exponential
back-off (`backoff_s`, doubled each time). With a launcher, a dead server is restarted first
(`ServerLauncher.ensure_alive`), given the latest weights again, and the requests that were in
flight on it are re-sent ("requeued") under fresh wire rids; without one, a request moves to the
next server. 4xx answers are the request's fault: raised at once as ValueError with the server's
message (which names the field). A request's wire rid is its own rid, suffixed `.retryN` on
retries so that a late original never collides with its replacement.

Weight sync (`update_weights`): by disk or by a process group with the servers, see
`weight_updater.py`.

Where each job lives: `transport.py` (blocking calls with retries, the errors), `routing.py`
(server choice, batches), `wire.py` (the JSON both ways), `weight_updater.py` (versions and
weight updates); this module is the facade and the async generation path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

import httpx

from axrl.inference.protocol import GenerateRequest, GenerateResult, settle_future, validate_submission
from axrl.inference.remote.launcher import ServerLauncher
from axrl.inference.remote.transport import BlockingTransport, Retryable, ServerUnavailable, backoff_delay, \
    error_message, server_context
from axrl.inference.remote.weights import ServerWeights
from axrl.inference.sglang.routing import Router, split_batches
from axrl.inference.sglang.weight_updater import WeightUpdater
from axrl.inference.sglang.wire import WireError, batch_to_wire, parse_weight_version, progress_from_chunk, \
    request_to_wire, result_from_wire

__all__ = ["SGLangEngine", "ServerUnavailable"]  # ServerUnavailable: re-exported from transport


class SGLangEngine:
    """HTTP client for one or more SGLang-compatible servers (see the module docstring).

    Args:
        urls: server base URLs, e.g. ["http://127.0.0.1:30000"].
        max_concurrency: HTTP requests in flight at once (a batch counts once).
        timeout_s: per-request read timeout (generation included); connect timeout is 10 s.
        retries, backoff_s: retry count and first back-off delay (doubled on each retry).
        launcher: the launcher that owns the servers (restarts on failure; stopped by shutdown()
            if `own_launcher`).
        weight_sync: "disk" or "distributed".
        export_dir: where disk sync writes HF directories (default: a temporary directory).
        model_dir: HF directory whose config.json/tokenizer files go next to exported weights
            (default: the launcher's model_path).
        routing_shape: (layers, top_k) of routed experts; default: from `axrl serve`'s model info.
        vocab_size: checked against every input id before sending (a real SGLang server crashes
            on an out-of-vocabulary id); default: from `axrl serve`'s model info, else unchecked.
        sync_backend: process-group backend for distributed sync ("gloo"; "nccl" on GPUs).
        master_address: address the servers reach the trainer's rendezvous at.
        bucket_bytes: largest `/update_weights_from_distributed` call (bytes of tensors).
        group_timeout_s: timeout of the weight process group's collectives.
    """

    def __init__(self, urls: Sequence[str], *, max_concurrency: int = 64, timeout_s: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, launcher: ServerLauncher | None = None,
                 own_launcher: bool = True, weight_sync: str = "disk", export_dir: str | Path | None = None,
                 model_dir: str | Path | None = None, routing_shape: tuple[int, int] | None = None,
                 vocab_size: int | None = None,
                 sync_backend: str = "gloo", master_address: str = "127.0.0.1",
                 bucket_bytes: int = 512 << 20, group_timeout_s: float = 300.0) -> None:
        urls = list(urls)
        if not urls:
            raise ValueError("urls: at least one server URL is needed (or a launcher that started servers)")
        for i, url in enumerate(urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"urls[{i}]={url!r}: expected an http(s) URL such as http://127.0.0.1:30000")
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be 'disk' or 'distributed', got {weight_sync!r}")
        if max_concurrency < 1 or retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError("need max_concurrency >= 1, retries >= 0, backoff_s >= 0 and timeout_s > 0")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_concurrency, self.timeout_s, self.retries, self.backoff_s = max_concurrency, timeout_s, retries, backoff_s
        self.launcher, self.own_launcher = launcher, own_launcher
        self.model_dir = Path(model_dir) if model_dir else (Path(launcher.model_path) if launcher else None)
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._transport = BlockingTransport(self.urls, self._timeout, retries, backoff_s, launcher)

        self._lock = threading.Lock()  # guards _inflight, _aborted and _router
        self._inflight: dict[str, tuple[int, str]] = {}   # rid → (server, wire rid)
        self._progress: dict[str, tuple[list[int], list[float]]] = {}  # streamed requests: ids, logprobs so far
        self._aborted: set[str] = set()
        self._running = [0] * len(self.urls)
        self._router = Router(len(self.urls))
        try:
            self._info = [self._model_info(i) for i in range(len(self.urls))]
        except BaseException:
            self._transport.close()
            raise
        self._own_export = export_dir is None
        self.export_dir = Path(export_dir) if export_dir else Path(tempfile.mkdtemp(prefix=f"axrl-{self.NAME}-weights-"))
        self.routing_shape = routing_shape or self._routing_shape_from_info()
        self.vocab_size = vocab_size or self._info[0].get("vocab_size")
        versions = [parse_weight_version(info.get("weight_version")) for info in self._info]
        self._weights = self._weight_updater(
            version=max([v for v in versions if v is not None], default=0), weight_sync=weight_sync,
            sync_backend=sync_backend, master_address=master_address, bucket_bytes=bucket_bytes,
            group_timeout_s=group_timeout_s)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="axrl-sglang-client", daemon=True)
        self._thread.start()
        self._http, self._sem, self._resync_locks = self._call(self._make_loop_objects())
        self._closed = False
        self._abort_retries: set[concurrent.futures.Future] = set()  # `_abort_again` tasks still running
        self.cleanup: list[Path] = []  # directories shutdown() removes (e.g. a temporary start-up export)

    # -- set-up helpers ----------------------------------------------------------------------------
    async def _make_loop_objects(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore, list[asyncio.Lock]]:
        """What must be created on the client's own event loop (they bind to it)."""
        limits = httpx.Limits(max_connections=self.max_concurrency + 8, max_keepalive_connections=self.max_concurrency)
        return (httpx.AsyncClient(timeout=self._timeout, limits=limits), asyncio.Semaphore(self.max_concurrency),
                [asyncio.Lock() for _ in self.urls])

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- what another server API changes (the vLLM client overrides these) ----------------------
    NAME = "sglang"                 # in temporary directory names
    GENERATE_PATH = "/generate"
    INFO_PATH = "/get_model_info"   # a JSON object with at least "weight_version"

    def _weight_updater(self, **options: Any) -> ServerWeights:
        """The weight routes of these servers (SGLang's `/update_weights_from_*`)."""
        return WeightUpdater(self._transport, self.launcher, export_dir=self.export_dir, model_dir=self.model_dir,
                             **options)

    def _abort_call(self, wire_rid: str) -> tuple[str, dict[str, Any]]:
        """(path, body) of the call that aborts request `wire_rid` on its server."""
        return "/abort_request", {"rid": wire_rid}

    def _request_body(self, server: int, reqs: list[GenerateRequest], rids: list[str]) -> dict[str, Any]:
        """The `GENERATE_PATH` body of one batch."""
        return request_to_wire(reqs[0], rids[0]) if len(reqs) == 1 else \
            batch_to_wire(reqs, rids, self._lists_ok(server))

    def _parse(self, url: str, data: Any, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """The results of one batch from the server's JSON answer."""
        bodies = data if len(reqs) > 1 else [data]
        if not isinstance(bodies, list) or len(bodies) != len(reqs):
            raise WireError(f"{url}{self.GENERATE_PATH} returned {type(data).__name__} for a batch of {len(reqs)}")
        return [result_from_wire(b, r, layers_topk=self.routing_shape, current_version=self._weights.version)
                for r, b in zip(reqs, bodies)]

    def _model_info(self, i: int) -> dict[str, Any]:
        resp = self._transport.control(i, "GET", self.INFO_PATH)
        return resp.json() if resp.status_code == 200 else {}

    def _routing_shape_from_info(self) -> tuple[int, int] | None:
        info = self._info[0]
        layers, top_k = info.get("num_hidden_layers"), info.get("num_experts_per_tok")
        return (int(layers), int(top_k)) if layers and top_k else None

    def _lists_ok(self, i: int) -> bool:
        """Whether server i takes a list of routed_experts_start_len in one batch (axrl serve)."""
        return bool(self._info[i].get("routed_experts_start_len_list"))

    def release_memory(self) -> None:
        """Every server frees its memory occupation (SGLang `/release_memory_occupation`; a real
        SGLang server needs `--enable-memory-saver`)."""
        self._transport.post_all("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        """Every server allocates again what `release_memory` freed (`/resume_memory_occupation`)."""
        self._transport.post_all("/resume_memory_occupation", {})

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to completion on its server (see the module docstring for retries)."""
        return await asyncio.wrap_future(self.submit(request))

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Send one request; the future resolves to its GenerateResult."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[GenerateRequest]) -> list[concurrent.futures.Future]:
        """Send several requests at once: one batched `/generate` per server, in this order."""
        if self._closed:
            raise RuntimeError("SGLangEngine is shut down")
        reqs = [req for req, _ in validate_submission(requests, vocab_size=self.vocab_size)]
        futures = [concurrent.futures.Future() for _ in reqs]
        groups: dict[int, list[int]] = {}
        with self._lock:
            for k, r in enumerate(reqs):
                if r.rid in self._inflight:
                    raise ValueError(f"rid: request {r.rid!r} is already in flight; wait for it or use another rid")
                groups.setdefault(self._router.route(r), []).append(k)
            for server, ks in groups.items():
                for k in ks:
                    self._inflight[reqs[k].rid] = (server, reqs[k].rid)
        for k, (r, f) in enumerate(zip(reqs, futures)):
            f.add_done_callback(lambda fut, rid=r.rid: fut.cancelled() and self.abort(rid))
        batches = [(server, batch) for server, ks in groups.items() for batch in self._split(server, ks, reqs)]
        asyncio.run_coroutine_threadsafe(self._run_batches(batches, reqs, futures), self._loop)
        return futures

    def generate_batch(self, requests: Iterable[GenerateRequest], timeout: float | None = None) -> list[GenerateResult]:
        """Submit all requests at once and wait for all; results in order."""
        return [f.result(timeout=timeout) for f in self.submit_many(requests)]

    def _route(self, req: GenerateRequest) -> int:
        """The server `req` goes to (see `Router.route`)."""
        with self._lock:
            return self._router.route(req)

    def _split(self, server: int, ks: list[int], reqs: list[GenerateRequest]) -> list[list[int]]:
        """Batches SGLang accepts: routing flags (and, except on axrl serve, start lengths) shared."""
        return split_batches(ks, reqs, self._lists_ok(server))

    async def _run_batches(self, batches: list[tuple[int, list[int]]], reqs: list[GenerateRequest],
                           futures: list[concurrent.futures.Future]) -> None:
        """Send the batches concurrently; resolve the futures only once all are back, in submission
        order, so that which server answered first never changes what the caller sees next (the
        round-clocked rollout's episode order, hence the trace, stays reproducible with many servers)."""
        outcomes = await asyncio.gather(*(self._send(server, [reqs[k] for k in ks]) for server, ks in batches),
                                        return_exceptions=True)
        by_index: dict[int, Any] = {}
        for (_, ks), outcome in zip(batches, outcomes):
            for j, k in enumerate(ks):
                by_index[k] = outcome if isinstance(outcome, BaseException) else outcome[j]
        with self._lock:
            for r in reqs:
                self._inflight.pop(r.rid, None)
                self._aborted.discard(r.rid)
                self._progress.pop(r.rid, None)
        for k, f in enumerate(futures):
            outcome = by_index[k]
            if isinstance(outcome, BaseException):
                settle_future(f, error=outcome)
            else:
                settle_future(f, outcome)

    async def _send(self, server: int, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """POST the batch, retrying (and re-routing or restarting) on transport errors and 5xx."""
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(backoff_delay(self.backoff_s, attempt))
                server = await self._recover(server, reqs)
            await self._resync_if_restarted(server)
            with self._lock:
                rids = [r.rid if attempt == 0 else f"{r.rid}.retry{attempt}" for r in reqs]
                for r, rid in zip(reqs, rids):
                    self._inflight[r.rid] = (server, rid)
            body = self._request_body(server, reqs, rids)
            url = self.urls[server]
            self._running[server] += len(reqs)
            try:
                async with self._sem:
                    with self._lock:
                        aborted = all(r.rid in self._aborted for r in reqs)
                    if aborted:  # aborted while queued here or waiting to be re-sent: nothing to run
                        return [self._aborted_result(r) for r in reqs]
                    resp = await (self._post_streaming(url, body, reqs[0]) if len(reqs) == 1 and reqs[0].stream
                                  else self._http.post(url + self.GENERATE_PATH, json=body))
            except httpx.TransportError as e:
                error = e
                if isinstance(e, httpx.TimeoutException):  # it may still run there: free its slot
                    await self._abort_wire(server, rids)
                continue
            finally:
                self._running[server] -= len(reqs)
            if resp.status_code >= 500:
                error = Retryable(f"HTTP {resp.status_code}: {error_message(resp)}")
                continue
            if resp.status_code >= 400:
                raise ValueError(f"{url}{self.GENERATE_PATH} rejected the request (HTTP {resp.status_code}): "
                                 f"{error_message(resp)}")
            results = self._parse(url, resp.json(), reqs)
            for res in results:
                res.meta["server"] = url
                res.meta["attempts"] = attempt + 1
            return results
        raise ServerUnavailable(f"{self.urls[server]}{self.GENERATE_PATH} failed after {self.retries + 1} attempts "
                                f"(retries={self.retries}, backoff_s={self.backoff_s}): "
                                f"{type(error).__name__}: {error}{server_context(self.launcher, server)}")

    async def _post_streaming(self, url: str, body: dict[str, Any], req: GenerateRequest) -> httpx.Response:
        """POST a streaming `/generate`: each chunk becomes the request's `progress`; returns the
        last chunk as the response a non-streaming call would have got (or the error response)."""
        last = None
        async with self._http.stream("POST", url + "/generate", json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                return resp
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # SGLang reports a failure once streaming started in-band
                    raise WireError(f"{url}/generate failed mid-stream: {chunk['error']}")
                snap = progress_from_chunk(chunk, req)
                with self._lock:
                    self._progress[req.rid] = snap
                last = chunk
        if last is None:
            raise WireError(f"{url}/generate ended its stream without a chunk (request {req.rid})")
        return httpx.Response(resp.status_code, json=last)

    def progress(self, rid: str) -> tuple[list[int], list[float]] | None:
        """What request `rid` has generated so far, for requests submitted with `stream=True`
        (see `axrl.inference.token_stream`); None otherwise or once it finished."""
        with self._lock:
            return self._progress.get(rid)

    def _aborted_result(self, req: GenerateRequest) -> GenerateResult:
        return GenerateResult(rid=req.rid, output_ids=[], output_logprobs=[], routed_experts=None,
                              finish_reason={"type": "abort", "message": "aborted by client before it was sent"},
                              weight_version=self._weights.version, prompt_tokens=len(req.input_ids))

    async def _recover(self, server: int, reqs: list[GenerateRequest]) -> int:
        """Before a retry: restart a dead launched server, or move the requests to the next server."""
        if self.launcher is not None:
            try:
                await asyncio.to_thread(self.launcher.ensure_alive, server)
            except RuntimeError:
                pass  # still down: this attempt fails too and the back-off grows
            return server
        with self._lock:
            return self._router.move(reqs, server)

    async def _resync_if_restarted(self, server: int) -> None:
        """A server the launcher restarted holds its start-up weights: load the latest ones first."""
        if self.launcher is None or self.launcher.restarts(server) == self._weights.synced_restarts[server]:
            return
        async with self._resync_locks[server]:
            restarts = self.launcher.restarts(server)
            if restarts == self._weights.synced_restarts[server]:
                return
            if self._weights.updated:
                await asyncio.to_thread(self._weights.resync, server)
            self._weights.synced_restarts[server] = restarts

    async def _abort_wire(self, server: int, rids: list[str]) -> None:
        for rid in rids:  # one rid per call: the form every SGLang version takes
            try:
                path, body = self._abort_call(rid)
                await self._http.post(self.urls[server] + path, json=body, timeout=5.0)
            except httpx.HTTPError:
                return

    # -- control -------------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        """Abort a request in flight (`POST /abort_request`); it finishes with finish_reason abort.
        Returns whether this client had it in flight."""
        with self._lock:
            where = self._inflight.get(rid)
            if where is None:
                return False
            self._aborted.add(rid)
        server, wire_rid = where
        try:
            path, body = self._abort_call(wire_rid)
            self._transport.client.post(self.urls[server] + path, json=body, timeout=10.0)
        except httpx.HTTPError:
            pass  # a dead server aborts nothing; the retry path sees `_aborted`
        if not self._closed:
            retry = asyncio.run_coroutine_threadsafe(self._abort_again(rid), self._loop)
            with self._lock:
                self._abort_retries.add(retry)
            retry.add_done_callback(self._abort_retries.discard)
        return True

    async def _abort_again(self, rid: str, tries: int = 5) -> None:
        """A server ignores aborts of rids it has not registered yet (the request may still be in
        transit): repeat the abort a few times while the request is still in flight."""
        for i in range(tries):
            await asyncio.sleep(0.1 * (i + 1))
            with self._lock:
                where = self._inflight.get(rid)
            if where is None:
                return
            server, wire_rid = where
            await self._abort_wire(server, [wire_rid])

    def update_weights(self, source: Any, version: int | None = None) -> int:
        """Load new weights on every server; returns the new version (`version`, else previous + 1).

        `source`: an HF-named state dict (sent by disk or process group, per `weight_sync`) or the
        path of an HF directory the servers can read (always by disk).
        """
        return self._weights.update(source, version)

    def health(self) -> dict[str, Any]:
        """{"ok", "weight_version", "running", "waiting", "servers": [{url, ok, weight_version, running,
        restarts}]}; `running` counts this client's requests in flight, `waiting` is always 0 (queues
        live in the servers)."""
        servers = []
        for i, url in enumerate(self.urls):
            entry: dict[str, Any] = {"url": url, "running": self._running[i],
                                     "restarts": self.launcher.restarts(i) if self.launcher else 0}
            try:
                entry["ok"] = self._transport.client.get(url + "/health", timeout=5.0).status_code == 200
                info = self._transport.client.get(url + self.INFO_PATH, timeout=5.0).json()
                entry["weight_version"] = info.get("weight_version")
            except (httpx.HTTPError, ValueError) as e:
                entry["ok"], entry["error"] = False, f"{type(e).__name__}: {e}"
            servers.append(entry)
        return {"ok": all(s["ok"] for s in servers), "weight_version": self._weights.version,
                "running": sum(self._running), "waiting": 0, "servers": servers}

    @property
    def weight_version(self) -> int:
        return self._weights.version

    @property
    def _updated(self) -> bool:
        """Whether update_weights ran (else the servers hold their start-up weights)."""
        return self._weights.updated

    def shutdown(self) -> None:
        """Abort what is in flight, close the connections and the weight group, stop the launcher
        if this client owns it, and remove the temporary export directory."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            rids = list(self._inflight)
        for rid in rids:
            self.abort(rid)
        with self._lock:
            retries = list(self._abort_retries)
        for retry in retries:   # cancelled on the loop before it stops, not destroyed pending with it
            retry.cancel()
        try:
            self._call(self._http.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._weights.leave_group()
            self._transport.close()
            if self.launcher is not None and self.own_launcher:
                self.launcher.stop()
            for path in [self.export_dir] * self._own_export + self.cleanup:
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
