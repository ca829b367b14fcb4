"""The rollout side as a Ray actor: engine client, rollout worker, pool, agent proxy, evaluator.

`RolloutActor` builds the same rollout side as a local run (`make_rollout_side`) around a
`RayEngine`, so the engine's results reach the agent loop here, never the driver; the engine
actor it starts is its own (it dies with it). A sealed batch is put in the object store by this
actor and the driver gets the reference only (`take`), which it hands to the learner actor.

`RayRollout` is the driver's handle: the `RolloutControl` and `BatchSource` of the loop. With
each batch it also receives the rollout snapshot taken at that moment (the groups started but
not yet trained: small metadata), so when the actor dies it starts a new one at the next step
from that snapshot, with the last weights it posted: the groups in flight, and any sealed but
not taken, are re-run under their own ids and seeds — no sample lost, none duplicated. Each
restart is an event; after `runtime.ray.rollout_restarts` of them the run fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from axrl.runtime.components import (RunSettings, embedded_engine_for, fresh_engine_model, make_data, make_engine,
                                     make_rollout_side, make_tokenizer)
from axrl.runtime.recording.events import EventLog
from axrl.ray_executor.activity import Activity, ActorBase
from axrl.ray_executor.calls import RestartableActor, RestartingHandle, close_actor, unwrap
from axrl.ray_executor.handles import DataPlane, WeightsHandle
from axrl.ray_executor.wire import wire_bytes
from axrl.ray_executor.settings import RaySettings
from axrl.ray_executor.trace_shards import engine_routing_by_reference, put_engine_routing


class RolloutActorLost(RuntimeError):
    """The rollout actor died more often than `runtime.ray.rollout_restarts` allows."""


class RolloutActor(ActorBase):
    """The rollout side in its own process. `rollout.engine: embedded`: its engine is an engine
    actor of its own (`RayEngine`); `sglang`: this actor is the servers' manager — it launches (or
    connects to) them and runs the SGLang client, with the launcher's restart-and-resync, and the
    weight handles it is given are fetched here and sent on by the configured route (disk or
    process group). `train`: an attachment to the train group (the servers' initial export)."""

    def __init__(self, settings: RunSettings, r: RaySettings, train: dict[str, Any], engine_options: dict[str, Any],
                 monitor_groups: dict[str, int]) -> None:
        import ray

        from axrl.ray_executor.actors import EngineActor
        from axrl.ray_executor.engine import RayEngine
        from axrl.ray_executor.train_group import RayTrainGroup

        torch.set_num_threads(settings.threads)
        self.events, self.plane = EventLog(), DataPlane(in_driver=False)
        self.activity_ = Activity("rollout worker")
        source, s = settings.model, settings.rollout
        tokenizer = make_tokenizer(source)
        task, loader = make_data(settings.data)
        group = RayTrainGroup.attach(ray, train, events=self.events, plane=self.plane, call_timeout_s=r.call_timeout_s)
        model_config = group.model_config
        self.engine: Any
        if s.engine in ("sglang", "vllm"):  # servers this actor launches and manages
            self.engine = make_engine(source, s, group, tokenizer)
            self.events.record("actors_started", component="engine", servers=list(self.engine.urls),
                               nodes=[ray.get_runtime_context().get_node_id()])
        else:
            remote = ray.remote(concurrency_groups=monitor_groups)(EngineActor)
            clocked = s.clock == "iterations"
            self.engine = RayEngine(ray, lambda: remote.options(**engine_options).remote(
                                        source, s.embedded, settings.threads, clocked),
                                    clocked=clocked, restarts=r.engine_restarts, events=self.events,
                                    plane=self.plane, call_timeout_s=r.call_timeout_s)
            self.events.record("actors_started", component="engine", pid=self.engine.pid,
                               nodes=[ray.get(self.engine.node())])
        self._fetches_weights = not isinstance(self.engine, RayEngine)
        self.routing_by_reference = engine_routing_by_reference(settings.learner)
        self.side = make_rollout_side(
            s, tokenizer, task, loader, self.engine, model_config,
            lambda clocked: embedded_engine_for(s.embedded, fresh_engine_model(source, model_config), tokenizer,
                                                clocked=clocked))

    def _weights(self, source: Any) -> Any:
        """What the engine takes: an engine actor fetches a handle itself; an SGLang client gets the
        weights fetched here (from train rank 0's object store, not through the driver)."""
        import ray

        if self._fetches_weights and isinstance(source, WeightsHandle):
            return ray.get(source.ref)   # counted once, where train rank 0 put it
        return source

    def attach(self, run_path: str) -> None:
        """Record this actor's events (the engine's restarts) into RUN/events.jsonl from now on."""
        self.events.attach(Path(run_path))

    def load_weights(self, source: Any, version: int) -> None:
        with self.activity_.doing(f"load_weights v{version}"):
            self.side.rollout.load_weights(self._weights(source), version)

    def start(self, first_step: int, state: dict[str, Any] | None) -> None:
        self.side.rollout.start(first_step, state)

    def take(self, step: int) -> tuple[list[Any], dict[str, Any]]:
        """([reference to sealed batch `step`], the rollout snapshot right after taking it)."""
        import ray

        with self.activity_.doing(f"take {step}"):
            batch = self.side.pool.take(step)
            if self.routing_by_reference:   # trace.sharded: the engine's routing goes to the ranks, past the learner
                put = put_engine_routing(ray, batch.trajectories)
                self.plane.by_reference("engine_routing", put)
            self.plane.by_reference("trajectories", wire_bytes(batch))
            self.activity_.count("batches")
            return [ray.put(batch)], self.side.rollout.snapshot(step + 1)

    def snapshot(self, next_step: int) -> dict[str, Any]:
        return self.side.rollout.snapshot(next_step)

    def post_weights(self, version: int, source: WeightsHandle) -> None:
        """Weights `version` from the learner, for the worker to load when its schedule says so."""
        self.side.sync.post(version, self._weights(source))

    def evaluate(self, source: WeightsHandle, version: int) -> float:
        import ray

        assert self.side.evaluator is not None
        with self.activity_.doing(f"eval v{version}"):
            return self.side.evaluator.evaluate(ray.get(source.ref), version)

    def activity(self) -> list[dict[str, Any]]:
        """This worker's heartbeat and its engine actor's (with the requests in flight)."""
        rows = super().activity()
        if self._fetches_weights:   # SGLang servers: their health is the client's
            rows[0]["engine"] = self.engine.health()
            return rows
        try:
            rows.append(self.engine.activity())
        except Exception as e:  # noqa: BLE001 — an unreachable engine is a row, not a crash
            rows.append({"component": "engine", "state": "unreachable", "pid": self.engine.pid,
                         "last_error": f"{type(e).__name__}: {str(e)[:200]}"})
        return rows

    def stop(self) -> None:
        self.side.rollout.stop()

    def close(self) -> dict[str, Any]:
        """Stop everything this actor runs; what it moved (for the driver's data-plane account)."""
        try:
            self.side.rollout.stop()
        finally:
            if self.side.proxy is not None:
                self.side.proxy.stop()
            self.engine.shutdown()
            if self.side.evaluator is not None:
                self.side.evaluator.close()
        return self.plane.snapshot()


class RayRollout(RestartingHandle):
    """The driver's handle of the rollout actor (see the module docstring)."""

    def __init__(self, ray: Any, make_actor: Callable[[], Any], *, restarts: int, events: EventLog, plane: DataPlane,
                 call_timeout_s: float, evaluates: bool) -> None:
        self._ray, self._events, self._plane, self._timeout = ray, events, plane, call_timeout_s
        self._run_path: str | None = None
        self._weights: tuple[Any, int] | None = None       # the last weights given: (source, version)
        self._resume: tuple[int, dict[str, Any] | None] | None = None   # where a new actor starts
        self._remote = RestartableActor(ray, make_actor, get=self._get, resume=self._resumed, events=events,
                                        component="rollout worker", name="rollout actor", budget=restarts,
                                        key="runtime.ray.rollout_restarts", lost=RolloutActorLost)
        self.evaluator = RayEvaluator(self) if evaluates else None

    # -- calls -----------------------------------------------------------------------------------
    def _get(self, ref: Any) -> Any:
        try:
            return self._ray.get(ref, timeout=self._timeout)
        except self._ray.exceptions.RayTaskError as e:
            raise unwrap(e) from None

    def _call(self, remote: Callable[[Any], Any], what: str) -> Any:
        """`remote(actor)`'s answer; when the actor is dead, start a new one where the dead one
        was and retry once."""
        return self._remote.call(remote, what)

    def _resumed(self, actor: Any) -> dict[str, Any]:
        """Bring a new actor to where the dead one was: attached to the run, the last weights
        loaded, started at the step being taken from the last snapshot. The event's fields."""
        if self._run_path is not None:
            self._get(actor.attach.remote(self._run_path))
        if self._weights is not None:
            self._get(actor.load_weights.remote(*self._weights))
        fields: dict[str, Any] = {"weight_version": None if self._weights is None else self._weights[1]}
        if self._resume is not None:
            first, state = self._resume
            self._get(actor.start.remote(first, state))
            fields.update(next_step=first, rerun_groups=list((state or {}).get("pending", [])))
        return fields

    # -- RolloutControl and BatchSource --------------------------------------------------------------
    def attach(self, run_path: Path) -> None:
        self._run_path = path = str(run_path)
        self._call(lambda a: a.attach.remote(path), "attach")

    def load_weights(self, source: Any, version: int) -> None:
        self._weights = (source, version)
        self._call(lambda a: a.load_weights.remote(source, version), "load_weights")

    def post_weights(self, version: int, source: WeightsHandle) -> None:
        self._weights = (source, version)
        self._call(lambda a: a.post_weights.remote(version, source), "post_weights")

    def start(self, first_step: int, state: dict[str, Any] | None = None) -> None:
        self._resume = (first_step, state)
        self._call(lambda a: a.start.remote(first_step, state), "start")

    def take(self, step: int, timeout: float | None = None) -> list[Any]:
        """[An object reference to sealed batch `step`] (the learner fetches it)."""
        refs, snapshot = self._call(lambda a: a.take.remote(step), "take")
        self._resume = (step + 1, snapshot)
        return refs

    def snapshot(self, next_step: int) -> dict[str, Any]:
        return self._call(lambda a: a.snapshot.remote(next_step), "snapshot")

    def evaluate(self, source: WeightsHandle, version: int) -> float:
        return float(self._call(lambda a: a.evaluate.remote(source, version), "evaluate"))

    def activity(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        rows = self._ray.get(self._remote.actor.activity.options(concurrency_group="monitor").remote(),
                             timeout=timeout_s)
        rows[0]["restarts"] = self.restarts
        return rows

    def node(self) -> str:
        """The Ray node the rollout actor runs on."""
        return self._get(self._remote.actor.node.remote())

    def stop(self) -> None:
        try:
            self._get(self._remote.actor.stop.remote())
        except Exception:  # noqa: BLE001 — a dead actor has stopped
            pass

    def close(self) -> None:
        plane = close_actor(self._ray, self._remote.actor)
        if plane is not None:
            self._plane.merge(plane)


class RayEvaluator:
    """The evaluator of the rollout actor, given weight handles (they never reach the driver)."""

    def __init__(self, rollout: RayRollout) -> None:
        self.rollout = rollout

    def evaluate(self, weights: WeightsHandle, version: int) -> float:
        """Mean held-out reward of the train group's weights `weights` (version `version`)."""
        return self.rollout.evaluate(weights, version)

    def close(self) -> None:
        """The actor closes its evaluator with itself."""
