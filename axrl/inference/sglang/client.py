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
(`SGLangLauncher.ensure_alive`), given the latest weights again, and the requests that were in
flight on it are re-sent ("requeued") under fresh wire rids; without one, a request moves to the
next server. 4xx answers are the request's fault: raised at once as ValueError with the server's
message (which names the field). A request's wire rid is its own rid, suffixed `.retryN` on
retries so that a late original never collides with its replacement.

Weight sync (`update_weights`): `weight_sync="disk"` exports the state dict as an HF directory
and calls `/update_weights_from_disk`; `"distributed"` builds a process group with every server
(`/init_weights_update_group`; the trainer is rank 0) and broadcasts the tensors inside
`/begin_weight_update` … `/end_weight_update` (skipped on servers that predate them), bucketed by
`bucket_bytes`. Both send `weight_version` = str(version).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx
import torch

from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams, settle_future
from axrl.inference.sglang import weight_sync
from axrl.inference.sglang.launcher import SGLangLauncher, free_port
from axrl.inference.sglang.wire import WireError, batch_to_wire, parse_weight_version, request_to_wire, \
    result_from_wire


_GROUP_IDS = itertools.count(1)  # weight-group names must be unique per trainer process


def _in_daemon_thread(fn: Any) -> concurrent.futures.Future:
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


class ServerUnavailable(ConnectionError):
    """A server could not be reached (or kept failing) after all retries."""


class _Retryable(Exception):
    """A failure worth retrying (5xx)."""


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body.get("error") or body)[:1000]
    return str(body)[:1000]


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
    """

    def __init__(self, urls: Sequence[str], *, max_concurrency: int = 64, timeout_s: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, launcher: SGLangLauncher | None = None,
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
        self.weight_sync, self.sync_backend, self.master_address = weight_sync, sync_backend, master_address
        self.bucket_bytes, self.group_timeout_s = bucket_bytes, group_timeout_s
        self.model_dir = Path(model_dir) if model_dir else (Path(launcher.model_path) if launcher else None)
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._sync = httpx.Client(timeout=self._timeout)

        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[int, str]] = {}   # rid → (server, wire rid)
        self._aborted: set[str] = set()
        self._running = [0] * len(self.urls)
        self._sticky_override: dict[str, int] = {}
        self._round_robin = itertools.count()
        self._version = 0
        self._updated = False                       # any update_weights yet (else servers hold model_path)
        self._last_dir: Path | None = None          # newest exported/loaded HF directory (resync after restart)
        self._last_state: dict[str, torch.Tensor] | None = None  # distributed: kept to resync a restarted server
        self._synced_restarts = [launcher.restarts(i) if launcher else 0 for i in range(len(self.urls))]
        self._group: Any = None
        self._group_name: str | None = None
        self._group_stale = False
        try:
            self._info = [self._model_info(i) for i in range(len(self.urls))]
        except BaseException:
            self._sync.close()
            raise
        self._own_export = export_dir is None
        self.export_dir = Path(export_dir) if export_dir else Path(tempfile.mkdtemp(prefix="axrl-sglang-weights-"))
        self.routing_shape = routing_shape or self._routing_shape_from_info()
        self.vocab_size = vocab_size or self._info[0].get("vocab_size")
        versions = [parse_weight_version(info.get("weight_version")) for info in self._info]
        self._version = max([v for v in versions if v is not None], default=0)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="axrl-sglang-client", daemon=True)
        self._thread.start()
        self._http, self._sem, self._resync_locks = self._call(self._make_loop_objects())
        self._closed = False
        self.cleanup: list[Path] = []  # directories shutdown() removes (e.g. a temporary start-up export)

    # -- set-up helpers ----------------------------------------------------------------------------
    async def _make_loop_objects(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore, list[asyncio.Lock]]:
        """What must be created on the client's own event loop (they bind to it)."""
        limits = httpx.Limits(max_connections=self.max_concurrency + 8, max_keepalive_connections=self.max_concurrency)
        return (httpx.AsyncClient(timeout=self._timeout, limits=limits), asyncio.Semaphore(self.max_concurrency),
                [asyncio.Lock() for _ in self.urls])

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _model_info(self, i: int) -> dict[str, Any]:
        resp = self._control(i, "GET", "/get_model_info")
        return resp.json() if resp.status_code == 200 else {}

    def _routing_shape_from_info(self) -> tuple[int, int] | None:
        info = self._info[0]
        layers, top_k = info.get("num_hidden_layers"), info.get("num_experts_per_tok")
        return (int(layers), int(top_k)) if layers and top_k else None

    def _lists_ok(self, i: int) -> bool:
        """Whether server i takes a list of routed_experts_start_len in one batch (axrl serve)."""
        return bool(self._info[i].get("routed_experts_start_len_list"))

    # -- control calls (blocking) --------------------------------------------------------------
    def _control(self, i: int, method: str, path: str, body: Any = None, ok404: bool = False) -> httpx.Response:
        """A blocking call to server i with retries (restarting it via the launcher if it died).
        Raises ServerUnavailable when it stays unreachable, ValueError on a 4xx answer."""
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep_backoff(attempt)
            try:
                resp = self._sync.request(method, self.urls[i] + path, json=body)
            except httpx.TransportError as e:
                error = e
                self._recover_blocking(i)
                continue
            if resp.status_code >= 500:
                error = _Retryable(f"HTTP {resp.status_code}: {_message(resp)}")
                continue
            if resp.status_code == 404 and ok404:
                return resp
            if resp.status_code >= 400:
                raise ValueError(f"{self.urls[i]}{path} rejected the request (HTTP {resp.status_code}): {_message(resp)}")
            return resp
        raise ServerUnavailable(f"{self.urls[i]}{path} failed after {self.retries + 1} attempts "
                                f"(retries={self.retries}, backoff_s={self.backoff_s}): {type(error).__name__}: {error}")

    def _sleep_backoff(self, attempt: int) -> None:
        threading.Event().wait(self.backoff_s * 2 ** (attempt - 1))

    def _recover_blocking(self, i: int) -> None:
        """After a transport error: restart a dead server (launcher only)."""
        if self.launcher is not None:
            try:
                self.launcher.ensure_alive(i)
            except RuntimeError:
                pass  # counted as a failed attempt; the next one tries again

    def _post_all(self, path: str, body: Any, ok404: bool = False) -> list[httpx.Response]:
        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(self._control, i, "POST", path, body, ok404) for i in range(len(self.urls))]
            return [f.result() for f in futures]

    def release_memory(self) -> None:
        """Every server frees its memory occupation (SGLang `/release_memory_occupation`; a real
        SGLang server needs `--enable-memory-saver`)."""
        self._post_all("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        """Every server allocates again what `release_memory` freed (`/resume_memory_occupation`)."""
        self._post_all("/resume_memory_occupation", {})

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
        reqs = [self._check(r) for r in requests]
        if len({r.rid for r in reqs}) != len(reqs):
            raise ValueError("rid: duplicate request ids in one submission")
        futures = [concurrent.futures.Future() for _ in reqs]
        groups: dict[int, list[int]] = {}
        with self._lock:
            for k, r in enumerate(reqs):
                if r.rid in self._inflight:
                    raise ValueError(f"rid: request {r.rid!r} is already in flight")
                groups.setdefault(self._route(r), []).append(k)
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

    def _check(self, req: GenerateRequest) -> GenerateRequest:
        if not isinstance(req, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(req).__name__}")
        if isinstance(req.sampling_params, Mapping):
            req.sampling_params = SamplingParams(**req.sampling_params)
        if not isinstance(req.rid, str) or not req.rid:
            raise ValueError(f"rid must be a non-empty string, got {req.rid!r}")
        if not req.input_ids:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if self.vocab_size is not None:
            bad = next((t for t in req.input_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return req

    def _route(self, req: GenerateRequest) -> int:
        n = len(self.urls)
        if req.sticky_key is None:
            return next(self._round_robin) % n
        if req.sticky_key in self._sticky_override:
            return self._sticky_override[req.sticky_key]
        digest = hashlib.blake2b(req.sticky_key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % n

    def _split(self, server: int, ks: list[int], reqs: list[GenerateRequest]) -> list[list[int]]:
        """Batches SGLang accepts: routing flags (and, except on axrl serve, start lengths) shared."""
        lists_ok = self._lists_ok(server)
        batches: dict[tuple, list[int]] = {}
        for k in ks:
            r = reqs[k]
            key = (r.return_routed_experts, None if lists_ok else r.routed_experts_start_len)
            batches.setdefault(key, []).append(k)
        return list(batches.values())

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
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                server = await self._recover(server, reqs)
            await self._resync_if_restarted(server)
            with self._lock:
                rids = [r.rid if attempt == 0 else f"{r.rid}.retry{attempt}" for r in reqs]
                for r, rid in zip(reqs, rids):
                    self._inflight[r.rid] = (server, rid)
            body = request_to_wire(reqs[0], rids[0]) if len(reqs) == 1 else \
                batch_to_wire(reqs, rids, self._lists_ok(server))
            url = self.urls[server]
            self._running[server] += len(reqs)
            try:
                async with self._sem:
                    with self._lock:
                        aborted = all(r.rid in self._aborted for r in reqs)
                    if aborted:  # aborted while queued here or waiting to be re-sent: nothing to run
                        return [self._aborted_result(r) for r in reqs]
                    resp = await self._http.post(url + "/generate", json=body)
            except httpx.TransportError as e:
                error = e
                if isinstance(e, httpx.TimeoutException):  # it may still run there: free its slot
                    await self._abort_wire(server, rids)
                continue
            finally:
                self._running[server] -= len(reqs)
            if resp.status_code >= 500:
                error = _Retryable(f"HTTP {resp.status_code}: {_message(resp)}")
                continue
            if resp.status_code >= 400:
                raise ValueError(f"{url}/generate rejected the request (HTTP {resp.status_code}): {_message(resp)}")
            data = resp.json()
            bodies = data if len(reqs) > 1 else [data]
            if not isinstance(bodies, list) or len(bodies) != len(reqs):
                raise WireError(f"{url}/generate returned {type(data).__name__} for a batch of {len(reqs)}")
            results = []
            for r, b in zip(reqs, bodies):
                res = result_from_wire(b, r, layers_topk=self.routing_shape, current_version=self._version)
                res.meta["server"] = url
                res.meta["attempts"] = attempt + 1
                results.append(res)
            return results
        raise ServerUnavailable(f"{self.urls[server]}/generate failed after {self.retries + 1} attempts "
                                f"(retries={self.retries}, backoff_s={self.backoff_s}): "
                                f"{type(error).__name__}: {error}")

    def _aborted_result(self, req: GenerateRequest) -> GenerateResult:
        return GenerateResult(rid=req.rid, output_ids=[], output_logprobs=[], routed_experts=None,
                              finish_reason={"type": "abort", "message": "aborted by client before it was sent"},
                              weight_version=self._version, prompt_tokens=len(req.input_ids))

    async def _recover(self, server: int, reqs: list[GenerateRequest]) -> int:
        """Before a retry: restart a dead launched server, or move the requests to the next server."""
        if self.launcher is not None:
            try:
                await asyncio.to_thread(self.launcher.ensure_alive, server)
            except RuntimeError:
                pass  # still down: this attempt fails too and the back-off grows
            return server
        if len(self.urls) == 1:
            return server
        moved = (server + 1) % len(self.urls)
        with self._lock:
            for r in reqs:
                if r.sticky_key is not None:
                    self._sticky_override[r.sticky_key] = moved
        return moved

    async def _resync_if_restarted(self, server: int) -> None:
        """A server the launcher restarted holds its start-up weights: load the latest ones first."""
        if self.launcher is None or self.launcher.restarts(server) == self._synced_restarts[server]:
            return
        async with self._resync_locks[server]:
            restarts = self.launcher.restarts(server)
            if restarts == self._synced_restarts[server]:
                return
            if self._updated:
                await asyncio.to_thread(self._resync_blocking, server)
            self._synced_restarts[server] = restarts

    def _resync_blocking(self, server: int) -> None:
        if self._last_dir is None and self._last_state is not None:
            self._last_dir = weight_sync.export_weights(self._last_state, self._require_model_dir(),
                                                        self.export_dir / "resync")
        self._group_stale = self.weight_sync == "distributed"  # the group lost a member
        self._control(server, "POST", "/update_weights_from_disk",
                      {"model_path": str(self._last_dir), "weight_version": str(self._version), "flush_cache": True})

    async def _abort_wire(self, server: int, rids: list[str]) -> None:
        for rid in rids:  # one rid per call: the form every SGLang version takes
            try:
                await self._http.post(self.urls[server] + "/abort_request", json={"rid": rid}, timeout=5.0)
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
            self._sync.post(self.urls[server] + "/abort_request", json={"rid": wire_rid}, timeout=10.0)
        except httpx.HTTPError:
            pass  # a dead server aborts nothing; the retry path sees `_aborted`
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._abort_again(rid), self._loop)
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
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version must be an int or None, got {version!r}")
        new = self._version + 1 if version is None else version
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path / 'config.json'} not found: update_weights needs an HF model directory")
            self._update_from_disk(path, new)
            self._last_state = None
        elif isinstance(source, Mapping):
            if self.weight_sync == "disk":
                self._update_from_disk(self._export(source, new), new)
            else:
                self._update_distributed(source, new)
        else:
            raise ValueError(f"update_weights source must be a state dict or an HF directory, got {type(source).__name__}")
        self._version, self._updated = new, True
        if self.launcher is not None:
            self._synced_restarts = [self.launcher.restarts(i) for i in range(len(self.urls))]
        return new

    def _require_model_dir(self) -> Path:
        if self.model_dir is None:
            raise ValueError("model_dir: exporting a state dict needs the model's HF directory (config.json, "
                             "tokenizer); pass model_dir= or a launcher")
        return self.model_dir

    def _export(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        out = weight_sync.export_weights(state_dict, self._require_model_dir(), self.export_dir / f"v{version}")
        for old in self.export_dir.glob("v*"):  # keep only the newest (a restarted server reloads it)
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return out

    def _update_from_disk(self, path: Path, version: int) -> None:
        self._post_all("/update_weights_from_disk", {"model_path": str(path.resolve()), "weight_version": str(version),
                                                     "flush_cache": True})
        self._last_dir = path

    def _update_distributed(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._ensure_group()
        self._post_all("/begin_weight_update", {}, ok404=True)
        parts = weight_sync.buckets(state_dict, self.bucket_bytes)
        for k, names in enumerate(parts):
            last = k == len(parts) - 1
            body = {**weight_sync.describe(state_dict, names), "group_name": self._group_name, "flush_cache": last,
                    "weight_version": str(version) if last else None}
            tensors = weight_sync.send_list(state_dict, names, self.sync_backend)
            self._with_collective("/update_weights_from_distributed", lambda i: body,
                                  lambda: weight_sync.broadcast_weights(self._group, tensors))
        self._post_all("/end_weight_update", {}, ok404=True)
        # A restarted server rejoins through disk with these (the live trainer tensors change later).
        self._last_state = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
        self._last_dir = None

    def _with_collective(self, path: str, body_for: Any, local: Any) -> Any:
        """POST `path` to every server while running the trainer's side of a collective; fail as
        soon as any side fails (a server that refuses never joins, so waiting would only hang)."""
        pool = concurrent.futures.ThreadPoolExecutor(len(self.urls) + 1)
        try:
            posts = [pool.submit(self._control, i, "POST", path, body_for(i)) for i in range(len(self.urls))]
            mine = _in_daemon_thread(local)
            done, _ = concurrent.futures.wait(posts + [mine], return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in posts + [mine]:
                if f in done and f.exception() is not None:
                    self._group_stale = True
                    raise f.exception()
            for f in posts:
                resp = f.result()
                if not resp.json().get("success", True):
                    self._group_stale = True
                    raise RuntimeError(f"{path} failed: {_message(resp)}")
            return mine.result()
        finally:
            pool.shutdown(wait=False)

    def _ensure_group(self) -> None:
        if self._group is not None and not self._group_stale:
            return
        self._leave_group()  # re-form without a dead member's leftovers
        name = f"axrl_weights_{os.getpid()}_{next(_GROUP_IDS)}"
        port, world = free_port(self.master_address), len(self.urls) + 1

        def body_for(i: int) -> dict[str, Any]:
            return {"master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                    "world_size": world, "group_name": name, "backend": self.sync_backend}

        self._group = self._with_collective("/init_weights_update_group", body_for, lambda: weight_sync.init_weights_group(
            master_address=self.master_address, master_port=port, rank=0, world_size=world, group_name=name,
            backend=self.sync_backend, timeout_s=self.group_timeout_s))
        self._group_name, self._group_stale = name, False

    def _leave_group(self) -> None:
        if self._group is None:
            return
        for i in range(len(self.urls)):
            try:
                self._sync.post(self.urls[i] + "/destroy_weights_update_group", json={"group_name": self._group_name},
                                timeout=10.0)
            except httpx.HTTPError:
                pass  # a dead server left the group anyway
        weight_sync.destroy_weights_group(self._group)
        self._group = None

    def health(self) -> dict[str, Any]:
        """{"ok", "weight_version", "running", "waiting", "servers": [{url, ok, weight_version, running,
        restarts}]}; `running` counts this client's requests in flight, `waiting` is always 0 (queues
        live in the servers)."""
        servers = []
        for i, url in enumerate(self.urls):
            entry: dict[str, Any] = {"url": url, "running": self._running[i],
                                     "restarts": self.launcher.restarts(i) if self.launcher else 0}
            try:
                entry["ok"] = self._sync.get(url + "/health", timeout=5.0).status_code == 200
                info = self._sync.get(url + "/get_model_info", timeout=5.0).json()
                entry["weight_version"] = info.get("weight_version")
            except (httpx.HTTPError, ValueError) as e:
                entry["ok"], entry["error"] = False, f"{type(e).__name__}: {e}"
            servers.append(entry)
        return {"ok": all(s["ok"] for s in servers), "weight_version": self._version,
                "running": sum(self._running), "waiting": 0, "servers": servers}

    @property
    def weight_version(self) -> int:
        return self._version

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
        try:
            self._call(self._http.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._leave_group()
            self._sync.close()
            if self.launcher is not None and self.own_launcher:
                self.launcher.stop()
            for path in [self.export_dir] * self._own_export + self.cleanup:
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
