"""The Ray executor: connect, place, start the train group, the rollout side and the learner as
actors, each handed the settings objects of what it builds (never the config).

Everything that can refuse the run does so here, before the run directory exists: a missing
Ray (the extra), a bad `runtime.ray.address`, an impossible `runtime.ray.placement`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axrl.runtime.components import RunSettings
from axrl.runtime.recording.events import EventLog
from axrl.console.health_table import health_table
from axrl.ray_executor.actors import TrainRankActor
from axrl.ray_executor.cluster import connect, import_ray
from axrl.ray_executor.handles import DataPlane
from axrl.ray_executor.wire import DriverWire
from axrl.ray_executor.learner import LearnerActor, RayLearner
from axrl.ray_executor.monitor import Monitor
from axrl.ray_executor.placement import Placement, place, train_slots
from axrl.ray_executor.reaper import start_reaper
from axrl.ray_executor.rollout import RayRollout, RolloutActor
from axrl.ray_executor.settings import RaySettings
from axrl.ray_executor.trace_shards import TRACE_GROUP
from axrl.ray_executor.train_group import RayTrainGroup
from axrl.trace.run_dir import atomic_write_text

DATA_PLANE_FILE = "data_plane.json"

# Calls that must answer while an actor is busy (heartbeats) run in their own thread there.
# The train ranks write their trace shards in one more (trace_shards.py).
MONITOR_GROUPS = {"monitor": 1, "poll": 1, TRACE_GROUP: 1}


class RayExecutor:
    """Owns the cluster connection and the placement groups of one run."""

    def __init__(self, settings: RunSettings, ray_settings: RaySettings, events: EventLog, engine: bool = True) -> None:
        """engine: reserve the engine's placement slot (False for a driver that runs only the train
        group, as the training service does; `start_rollout` is then refused)."""
        ray = import_ray()
        self.owns_cluster = not ray.is_initialized() and ray_settings.address is None
        self.ray = connect(ray_settings)
        # A local cluster of this run's own: reaped with the driver, however the driver ends.
        self.reaper = start_reaper() if self.owns_cluster else None
        self.settings, self.r, self.events, self.plane = settings, ray_settings, events, DataPlane()
        # From here until `close` writes RUN/data_plane.json, every get / put / actor call / actor
        # start of this process is measured at its serialised size (wire.py).
        self.wire: DriverWire | None = DriverWire(self.plane).open()
        self.train_group: RayTrainGroup | None = None
        self.rollout: RayRollout | None = None
        self.learner: RayLearner | None = None
        self.monitor: Monitor | None = None
        self.placement: Placement | None = None
        try:
            self.placement = place(self.ray, ray_settings.placement,
                                   train_slots(settings.backend, ray_settings.train_ranks), engine=engine)
        except BaseException:
            self.close()
            raise

    def start_train_group(self) -> RayTrainGroup:
        """Torch: one `TrainRankActor` per data-parallel rank, each in its slot. Megatron: one head
        actor holding the backend (no CPUs of its own), its Megatron ranks in the slots."""
        world, s = self.r.train_ranks, self.settings
        remote = self.ray.remote(concurrency_groups=MONITOR_GROUPS)(TrainRankActor)
        build = (s.model, s.backend, s.threads, self.r.call_timeout_s)

        def make_ranks() -> list[Any]:
            if s.backend.kind == "megatron":
                slots = [slot.options() for slot in self.placement.train]
                return [remote.options(num_cpus=0).remote(*build, 0, 1, slots)]
            return [remote.options(**slot.options()).remote(*build, rank, world)
                    for rank, slot in enumerate(self.placement.train)]

        self.train_group = RayTrainGroup.start(self.ray, make_ranks, events=self.events, plane=self.plane,
                                               call_timeout_s=self.r.call_timeout_s)
        nodes = self.ray.get([r.node.remote() for r in self.train_group.ranks])
        self.events.record("actors_started", component="train group", ranks=world, pids=self.train_group.pids,
                           nodes=nodes)
        return self.train_group

    def start_rollout(self) -> RayRollout:
        """The rollout actor; it starts its engine actor in the engine's placement slot. Scheduled
        with no CPUs of its own (as the driver is): its work is the agent loop between engine steps."""
        assert self.train_group is not None
        if self.placement.engine is None:
            raise RuntimeError("this RayExecutor was placed without an engine slot (engine=False): it starts no rollout")
        remote = self.ray.remote(concurrency_groups=MONITOR_GROUPS)(RolloutActor)
        engine_options, train = self.placement.engine.options(), self.train_group.attachment()
        s, r = self.settings, self.r
        # SGLang servers are the rollout actor's own processes: it takes the engine's slot.
        options = engine_options if s.rollout.engine in ("sglang", "vllm") else {"num_cpus": 0}

        def make_actor() -> Any:
            return remote.options(**options).remote(s, r, train, engine_options, MONITOR_GROUPS)

        self.rollout = RayRollout(self.ray, make_actor, restarts=r.rollout_restarts, events=self.events,
                                  plane=self.plane, call_timeout_s=r.call_timeout_s,
                                  evaluates=bool(s.rollout.eval.every))
        self.events.record("actors_started", component="rollout worker", pid=self.rollout.pid,
                           nodes=[self.rollout.node()])
        return self.rollout

    def start_learner(self, run_path: Path, backend: RayTrainGroup, rollout: RayRollout) -> RayLearner:
        """The learner actor, recording into `run_path`, over the train group's ranks."""
        remote = self.ray.remote(concurrency_groups=MONITOR_GROUPS)(LearnerActor)
        actor = remote.options(num_cpus=0).remote(self.settings.learner, self.settings.threads, self.r.call_timeout_s,
                                                  str(run_path), backend.attachment())
        self.learner = RayLearner(self.ray, actor, backend=backend, rollout=rollout, plane=self.plane,
                                  call_timeout_s=self.r.call_timeout_s)
        self.events.record("actors_started", component="learner", pid=self.learner.pid,
                           nodes=[self.ray.get(actor.node.remote())])
        if self.monitor is not None:
            self.monitor.add("learner", self.learner.activity)
        return self.learner

    def attach(self, run_path: Path) -> None:
        """The actors record their events into the run directory from now on."""
        if self.rollout is not None:
            self.rollout.attach(run_path)

    def start_monitor(self) -> Monitor:
        """Heartbeats of every actor into RUN/status.json every `runtime.ray.heartbeat_s`."""
        sources = {}
        if self.train_group is not None:
            sources["train group"] = self.train_group.activity
        if self.rollout is not None:
            sources["rollout"] = self.rollout.activity
        self.monitor = Monitor(sources, self.events, self.r.heartbeat_s).start()
        return self.monitor

    def health(self) -> Any:
        """The actors' health table from the latest heartbeats (shown live under the progress bar)."""
        if self.monitor is None:
            return None
        at, rows = self.monitor.latest()
        return health_table(rows, at, title="actors") if rows else None

    def actor_pids(self) -> dict[str, list[int]]:
        """PIDs of the run's actors now (for tests and `axrl status`)."""
        out: dict[str, list[int]] = {}
        if self.train_group is not None:
            out["train"] = list(self.train_group.pids)
        if self.rollout is not None:
            out["rollout"] = [self.rollout.pid]
        if self.learner is not None:
            out["learner"] = [self.learner.pid]
        return out

    def close(self) -> None:
        """Release the placement groups; stop the local cluster this run started."""
        if self.monitor is not None:
            self.monitor.stop()
        if self.learner is not None:   # the actors' data-plane accounts are folded in here
            self.learner.shutdown()
        if self.rollout is not None:
            self.rollout.close()
        if self.wire is not None:
            self.wire.close()
            self.wire = None
        if self.events.run_path is not None:  # what moved through the driver and what by reference
            atomic_write_text(self.events.run_path / DATA_PLANE_FILE,
                              json.dumps(self.plane.snapshot(), indent=1, sort_keys=True) + "\n")
        if self.placement is not None:
            self.placement.release(self.ray)
        if self.owns_cluster:
            self.ray.shutdown()
        if self.reaper is not None:
            self.reaper.stdin.close()  # reap what shutdown left (agents that exit late)
            self.reaper.wait(timeout=30)
