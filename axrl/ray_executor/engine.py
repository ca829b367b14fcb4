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
from axrl.runtime.recording.events import EventLog
from axrl.ray_executor.calls import RestartableActor, RestartingHandle, close_actor, is_dead, unwrap
from axrl.ray_executor.handles import DataPlane, WeightsHandle, payload_bytes
from axrl.ray_executor.wire import wire_bytes


class EngineActorLost(RuntimeError):
    """The engine actor died more often than `runtime.ray.engine_restarts` allows."""


class RayEngine(RestartingHandle):
    def __init__(self, ray: Any, make_actor: Callable[[], Any], *, clocked: bool, restarts: int, events: EventLog,
                 plane: DataPlane, call_timeout_s: float = 600.0) -> None:
        self._ray, self.clocked, self._plane, self._timeout = ray, clocked, plane, call_timeout_s
        self._lock = threading.RLock()
        self._pending: OrderedDict[str, tuple[GenerateRequest, concurrent.futures.Future]] = OrderedDict()
        self._version = 0
        self._source: Any = None            # the last weights given (an object ref), reloaded after a restart
        self._closed = False
        # The swap holds the handle's lock: what is in flight is resubmitted before anything is added.
        self._remote = RestartableActor(ray, make_actor, get=self._get, resume=self._resumed, events=events,
                                        component="engine", name="engine actor", budget=restarts,
                                        key="runtime.ray.engine_restarts", lost=EngineActorLost, lock=self._lock)
        self._poller: threading.Thread | None = None
        if not clocked:  # a free-running engine finishes requests on its own: collect them
            self._poller = threading.Thread(target=self._poll, name="axrl-ray-engine-poll", daemon=True)
            self._poller.start()

    # -- calls -----------------------------------------------------------------------------------
    def _get(self, ref: Any) -> Any:
        return self._ray.get(ref, timeout=self._timeout)

    def _dead(self, error: BaseException) -> bool:
        return is_dead(self._ray, error)

    def _call(self, remote: Callable[[Any], Any], what: str) -> Any:
        """`remote(actor)`'s answer; when the actor is dead, restart it (resubmitting what is in
        flight) and retry once."""
        return self._remote.call(remote, what, closed=lambda: self._closed)

    def _resumed(self, actor: Any) -> dict[str, Any]:
        """Bring a new actor to where the dead one was (called under the lock): the last weights
        loaded, every request in flight resubmitted in order. The event's fields."""
        if self._source is not None:
            self._get(actor.update_weights.remote(self._source, self._version))
        requests = [req for req, _ in self._pending.values()]
        if requests:
            self._get(actor.submit_many.remote(requests))
        return {"weight_version": self._version, "requeued_requests": len(requests),
                "requeued_rids": [r.rid for r in requests]}

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
            actor = self._remote.actor
            try:
                self._resolve(self._get(actor.drain.options(concurrency_group="poll").remote(0.2)))
            except Exception as e:  # noqa: BLE001
                if self._closed:
                    return
                try:
                    if not self._dead(e):
                        raise
                    self._remote.restart(actor, f"drain: {type(e).__name__}")
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
        try:
            actor = self._remote.actor
            self._get(actor.submit_many.remote(requests))
        except Exception as e:  # noqa: BLE001
            if not self._dead(e):
                with self._lock:
                    for req in requests:
                        self._pending.pop(req.rid, None)
                raise unwrap(e)
            self._remote.restart(actor, f"submit_many: {type(e).__name__}")  # resubmits these too
        return futures

    def step(self) -> bool:
        worked, finished = self._call(lambda a: a.step.remote(), "step")
        self._resolve(finished)
        return bool(worked)

    def update_weights(self, source: Any, version: int | None = None) -> int:
        if isinstance(source, WeightsHandle):
            ref = source.ref  # the actor fetches it from the train rank's object store (counted there, once)
        elif isinstance(source, Mapping):
            weights = {n: t.detach() for n, t in source.items()}
            ref = self._ray.put(weights)
            self._plane.by_reference("weights", wire_bytes(weights))
        else:
            ref = source  # an HF directory the actor reads itself
        with self._lock:
            self._source = ref
            new = self._call(lambda a: a.update_weights.remote(ref, version), "update_weights")
            self._version = int(new)
        return self._version

    def release_memory(self) -> None:
        self._call(lambda a: a.release_memory.remote(), "release_memory")

    def resume_memory(self) -> None:
        self._call(lambda a: a.resume_memory.remote(), "resume_memory")

    def abort(self, rid: str) -> bool:
        found, finished = self._call(lambda a: a.abort.remote(rid), "abort")
        self._resolve(finished)
        return bool(found)

    def health(self) -> dict[str, Any]:
        try:
            return {**self._get(self._remote.actor.health.remote()), "pid": self.pid, "restarts": self.restarts}
        except Exception as e:  # noqa: BLE001 — report, do not raise: health is a question
            return {"ok": False, "weight_version": self._version, "running": 0, "waiting": len(self._pending),
                    "error": f"{type(e).__name__}: {e}", "pid": self.pid, "restarts": self.restarts}

    def activity(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The actor's heartbeat (answered by its monitor thread even while it works), with the
        driver's count of requests in flight and the restarts so far."""
        report = self._ray.get(self._remote.actor.activity.options(concurrency_group="monitor").remote(),
                               timeout=timeout_s)[0]
        with self._lock:
            return {**report, "in_flight": len(self._pending), "restarts": self.restarts}

    def node(self) -> Any:
        """Object ref of the Ray node id the actor runs on."""
        return self._remote.actor.node.options(concurrency_group="monitor").remote()

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._resolve(self._get(self._remote.actor.shutdown.remote()))
        except Exception:  # noqa: BLE001 — a dead actor has nothing left to finish
            pass
        with self._lock:
            pending, self._pending = list(self._pending.values()), OrderedDict()
        for req, future in pending:
            settle_future(future, GenerateResult(req.rid, [], [], None, {"type": "abort", "message": "engine shut down"},
                                                weight_version=self._version))
        if self._poller is not None:
            self._poller.join(timeout=5)
        close_actor(self._ray, self._remote.actor, ask=False)
