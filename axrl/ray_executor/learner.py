"""The learner as a Ray actor: processor, train worker and trace recorder next to the train ranks.

`LearnerActor` runs the in-process `Learner` — the same code as a local run — over its own
`RayTrainGroup` attached to the driver's train ranks. It fetches the sealed batch from the
rollout actor's object store itself, sends each rank the reference to its shard, receives the
ranks' per-token outputs and writes the step's trace file; the driver gets back the step's
metrics, its phase times and the handle of the new weights (an object reference in train rank
0's store), which it passes on to the rollout actor. Nothing per token passes through the driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from axrl.runtime.components import LearnerSettings, make_step_trainer
from axrl.runtime.recording.events import EventLog
from axrl.ray_executor.activity import Activity, ActorBase
from axrl.ray_executor.calls import close_actor, is_dead, unwrap
from axrl.ray_executor.handles import DataPlane
from axrl.ray_executor.rollout import RayRollout
from axrl.ray_executor.trace_shards import RankShards
from axrl.ray_executor.train_group import RayTrainGroup, TrainGroupLost


class LearnerActor(ActorBase):
    def __init__(self, settings: LearnerSettings, threads: int, call_timeout_s: float, run_path: str,
                 attachment: dict[str, Any]) -> None:
        import ray

        from axrl.runtime.learner import Learner
        from axrl.sync import WeightSync
        from axrl.trace import RunDir

        torch.set_num_threads(threads)
        self.events, self.plane = EventLog(), DataPlane(in_driver=False)
        self.events.attach(Path(run_path))
        self.activity_ = Activity("learner")
        backend = RayTrainGroup.attach(ray, attachment, events=self.events, plane=self.plane,
                                       call_timeout_s=call_timeout_s)
        self.sync = WeightSync(version=0)
        run = RunDir(run_path)
        # trace.sharded: the ranks write the routing rows they hold; this actor the step's index
        record = settings.record
        self.shards = (RankShards(backend, run.trace_dir, record.routing_encoding, record.tiers)
                       if record.sharded and record.trace else None)
        self.learner = Learner(make_step_trainer(settings, backend, self.sync), run, settings.record, self.shards)

    def step(self, batch_refs: list[Any], step: int, times: dict[str, float]) -> tuple[dict[str, Any], dict[str, float],
                                                                                       list[Any]]:
        """Train on the batch behind `batch_refs[0]` and record it: (metrics, phase times, [new weights handle])."""
        import ray

        from axrl.console.progress import PhaseTimer

        with self.activity_.doing(f"step {step}"):
            batch = ray.get(batch_refs[0])
            # what of the engine's routing this process holds (none when it came by reference)
            self.plane.moved("engine_routing_at_learner", sum(int(t.routed_experts.nbytes) for t in batch.trajectories
                                                              if t.routed_experts is not None))
            if self.shards is not None:
                self.shards.batch(batch.trajectories)
            timer = PhaseTimer()
            timer.times.update(times)   # the driver's wait for the batch is part of the step's time
            metrics = self.learner.step(batch, step, timer)
            self.activity_.count("steps")
            timer.times["written_through"] = self.learner.written_through()
            return metrics, timer.times, [self.sync.get()[1]]

    def flush(self) -> float:
        """Return once every step file recorded so far is on disk; the latest step on disk."""
        self.learner.flush()
        return self.learner.written_through()

    def close(self) -> dict[str, Any]:
        """Write the queued step files; what this actor moved (for the driver's data-plane account)."""
        self.learner.close()
        return self.plane.snapshot()


class RayLearner:
    """The driver's handle of the learner actor: a `StepLearner`. The new weights of each step go
    straight on to the rollout actor as a handle."""

    def __init__(self, ray: Any, actor: Any, *, backend: RayTrainGroup, rollout: RayRollout, plane: DataPlane,
                 call_timeout_s: float) -> None:
        self._ray, self._actor, self._backend, self._rollout = ray, actor, backend, rollout
        self._plane, self._timeout = plane, call_timeout_s
        self.pid = self._get(actor.pid.remote())
        self._written_through: float = -1

    def _get(self, ref: Any) -> Any:
        try:
            return self._ray.get(ref, timeout=self._timeout)
        except self._ray.exceptions.RayTaskError as e:
            error = unwrap(e)
        except Exception as e:  # noqa: BLE001 — classified just below
            if not is_dead(self._ray, e):
                raise
            # The learner is the train side's driver: losing it loses the step, like losing a rank.
            error = TrainGroupLost(f"the learner actor died ({type(e).__name__}); the train group restarts from "
                                   "the last checkpoint (runtime.ray.train_restarts)")
        if isinstance(error, TrainGroupLost):
            self._backend.lost = True   # the driver's handle of the same ranks: do not wait on survivors
        raise error from None

    def step(self, batch: list[Any], step: int, timer: Any) -> dict[str, Any]:
        timer.show("train")
        metrics, times, weights = self._get(self._actor.step.remote(batch, step, dict(timer.times)))
        self._written_through = times.pop("written_through")
        timer.times.update(times)
        self._rollout.post_weights(step + 1, weights[0])
        return metrics

    def activity(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The learner actor's heartbeat (answered by its monitor thread even while it trains)."""
        return self._ray.get(self._actor.activity.options(concurrency_group="monitor").remote(), timeout=timeout_s)

    def flush(self) -> None:
        """Return once the actor has every step file recorded so far on disk."""
        self._written_through = self._get(self._actor.flush.remote())

    def written_through(self) -> float:
        """The latest step whose trace file the actor had on disk when it last answered."""
        return self._written_through

    def close(self) -> None:
        """Write the step files still queued (the loop's end; the actor stays up until `shutdown`)."""
        try:
            self.flush()
        except TrainGroupLost:  # a dead learner has nothing left to write; the loop reports why it stopped
            pass

    def shutdown(self) -> None:
        """Stop the actor (the executor's close), folding its data-plane account into the driver's."""
        plane = close_actor(self._ray, self._actor)
        if plane is not None:
            self._plane.merge(plane)
