"""RayEngine: the `ClockedEngine` protocol, implemented by calling an engine actor.

The rollout worker and its clock drive it exactly as they drive an in-process engine: the same
submissions between the same `step()` calls, so a deterministic run computes the same bits.
Requests are validated and queued by the actor when `submit_many` returns; each `step()` runs
one engine iteration there and brings back the requests that finished in it, which resolve the
local futures before `step()` returns (as the engine's own done-callbacks would).

Recovery: when the actor dies (detected by any call), a new one is started, loaded with the
last weights it was given (still in the object store) and handed every request in flight, in
their order — their episodes continue, the interrupted turns re-run from their prompts with the
same sampling seeds, so no sample is lost or duplicated. Each restart is an event; after
`runtime.ray.engine_restarts` of them the run fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Mapping

from axrl.inference.protocol import GenerateRequest, GenerateResult, settle_future
from axrl.runtime.events import EventLog
from axrl.runtime.ray.calls import call_or_restart, close_actor, is_dead, unwrap
from axrl.runtime.ray.handles import DataPlane, WeightsHandle, payload_bytes


class EngineActorLost(RuntimeError):
    """The engine actor died more often than `runtime.ray.engine_restarts` allows."""


class RayEngine:
    def __init__(self, ray: Any, make_actor: Callable[[], Any], *, clocked: bool, restarts: int, events: EventLog,
                 plane: DataPlane, call_timeout_s: float = 600.0) -> None:
        self._ray, self._make_actor, self.clocked = ray, make_actor, clocked
        self._max_restarts, self.restarts, self._events, self._plane = restarts, 0, events, plane
        self._timeout = call_timeout_s
        self._lock = threading.RLock()
        self._pending: OrderedDict[str, tuple[GenerateRequest, concurrent.futures.Future]] = OrderedDict()
        self._version = 0
        self._source: Any = None            # the last weights given (an object ref), reloaded after a restart
        self._closed = False
        self._actor = make_actor()
        self.pid = self._get(self._actor.pid.remote())
        self._poller: threading.Thread | None = None
        if not clocked:  # a free-running engine finishes requests on its own: collect them
            self._poller = threading.Thread(target=self._poll, name="axrl-ray-engine-poll", daemon=True)
            self._poller.start()

    # -- calls -----------------------------------------------------------------------------------
    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref, timeout=self._timeout)

    def _dead(self, error: BaseException) -> bool:
        return is_dead(self._ray, error)

    def _call(self, method: str, *args: Any) -> Any:
        """Call the actor; when it is dead, restart it (resubmitting what is in flight) and retry once."""
        return call_or_restart(self._ray, lambda: self._actor,
                               lambda actor: self._get(getattr(actor, method).remote(*args)), self._restart, method,
                               closed=lambda: self._closed)

    def _restart(self, dead: Any, reason: str) -> None:
        with self._lock:
            if dead is not self._actor:  # another thread already restarted it
                return
            if self.restarts >= self._max_restarts:
                self._events.record("actor_failed", component="engine", pid=self.pid, reason=reason,
                                    restarts=self.restarts)
                raise EngineActorLost(f"the engine actor died again ({reason}) after {self.restarts} restart(s) "
                                      f"(runtime.ray.engine_restarts={self._max_restarts}); the run stops")
            self.restarts += 1
            close_actor(self._ray, dead, ask=False)
            old_pid = self.pid
            self._actor = self._make_actor()
            self.pid = self._get(self._actor.pid.remote())
            if self._source is not None:
                self._get(self._actor.update_weights.remote(self._source, self._version))
            requests = [req for req, _ in self._pending.values()]
            if requests:
                self._get(self._actor.submit_many.remote(requests))
            self._events.record("actor_restarted", component="engine", reason=reason, old_pid=old_pid,
                                new_pid=self.pid, weight_version=self._version, requeued_requests=len(requests),
                                requeued_rids=[r.rid for r in requests], restart=self.restarts)

    def _resolve(self, finished: list[tuple[str, GenerateResult | None, BaseException | None]]) -> None:
        for rid, result, error in finished:
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is None:
                continue
            self._plane.moved("engine_results", payload_bytes(result))
            settle_future(entry[1], result, error)

    def _poll(self) -> None:
        """Free-running engines: collect finished requests (in the actor's own poll thread, so
        submissions are never queued behind the wait); a dead actor is restarted like on a call."""
        while not self._closed:
            actor = self._actor
            try:
                self._resolve(self._get(actor.drain.options(concurrency_group="poll").remote(0.2)))
            except Exception as e:  # noqa: BLE001
                if self._closed:
                    return
                try:
                    if not self._dead(e):
                        raise
                    self._restart(actor, f"drain: {type(e).__name__}")
                except Exception as fatal:  # noqa: BLE001 — fail what is in flight rather than hang
                    with self._lock:
                        pending, self._pending = list(self._pending.values()), OrderedDict()
                    for _, future in pending:
                        settle_future(future, error=fatal)
                    return

    # -- InferenceEngine -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await asyncio.wrap_future(self.submit_many([request])[0])

    def submit_many(self, requests: Iterable[GenerateRequest]) -> list[concurrent.futures.Future]:
        requests = list(requests)
        futures = [concurrent.futures.Future() for _ in requests]
        with self._lock:
            for req, f in zip(requests, futures):
                self._pending[req.rid] = (req, f)
        self._plane.moved("engine_requests", 4 * sum(len(r.input_ids) for r in requests))
        try:
            actor = self._actor
            self._get(actor.submit_many.remote(requests))
        except Exception as e:  # noqa: BLE001
            if not self._dead(e):
                with self._lock:
                    for req in requests:
                        self._pending.pop(req.rid, None)
                raise unwrap(e)
            self._restart(actor, f"submit_many: {type(e).__name__}")  # resubmits these too
        return futures

    def step(self) -> bool:
        worked, finished = self._call("step")
        self._resolve(finished)
        return bool(worked)

    def update_weights(self, source: Any, version: int | None = None) -> int:
        if isinstance(source, WeightsHandle):
            ref = source.ref  # the actor fetches it from the train rank's object store
            self._plane.by_reference("weights", source.nbytes)
        elif isinstance(source, Mapping):
            weights = {n: t.detach() for n, t in source.items()}
            ref = self._ray.put(weights)
            self._plane.moved("weights", payload_bytes(weights))
        else:
            ref = source  # an HF directory the actor reads itself
        with self._lock:
            self._source = ref
            new = self._call("update_weights", ref, version)
            self._version = int(new)
        return self._version

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def abort(self, rid: str) -> bool:
        found, finished = self._call("abort", rid)
        self._resolve(finished)
        return bool(found)

    def health(self) -> dict[str, Any]:
        try:
            return {**self._get(self._actor.health.remote()), "pid": self.pid, "restarts": self.restarts}
        except Exception as e:  # noqa: BLE001 — report, do not raise: health is a question
            return {"ok": False, "weight_version": self._version, "running": 0, "waiting": len(self._pending),
                    "error": f"{type(e).__name__}: {e}", "pid": self.pid, "restarts": self.restarts}

    def activity(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The actor's heartbeat (answered by its monitor thread even while it works), with the
        driver's count of requests in flight and the restarts so far."""
        report = self._ray.get(self._actor.activity.options(concurrency_group="monitor").remote(), timeout=timeout_s)
        with self._lock:
            return {**report, "in_flight": len(self._pending), "restarts": self.restarts}

    def node(self) -> Any:
        """Object ref of the Ray node id the actor runs on."""
        return self._actor.node.options(concurrency_group="monitor").remote()

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._resolve(self._get(self._actor.shutdown.remote()))
        except Exception:  # noqa: BLE001 — a dead actor has nothing left to finish
            pass
        with self._lock:
            pending, self._pending = list(self._pending.values()), OrderedDict()
        for req, future in pending:
            settle_future(future, GenerateResult(req.rid, [], [], None, {"type": "abort", "message": "engine shut down"},
                                                weight_version=self._version))
        if self._poller is not None:
            self._poller.join(timeout=5)
        close_actor(self._ray, self._actor, ask=False)
