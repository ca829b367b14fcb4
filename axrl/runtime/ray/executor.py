"""The Ray side of `build_components`: connect, place, start the train group and the engine.

Everything that can refuse the run does so here, before the run directory exists: a missing
Ray (the extra), a bad `runtime.ray.address`, an impossible `runtime.ray.placement`.
"""

from __future__ import annotations

import json
from typing import Any

from axrl.config import Config, config_to_dict
from axrl.runtime.events import EventLog
from axrl.runtime.ray.actors import EngineActor, TrainRankActor
from axrl.runtime.ray.cluster import connect, import_ray
from axrl.runtime.ray.engine import RayEngine
from axrl.runtime.ray.handles import DataPlane
from axrl.runtime.ray.monitor import Monitor
from axrl.runtime.ray.placement import Placement, place
from axrl.runtime.ray.reaper import start_reaper
from axrl.runtime.ray.train_group import RayTrainGroup
from axrl.trace.run_dir import atomic_write_text

DATA_PLANE_FILE = "data_plane.json"

# Calls that must answer while an actor is busy (heartbeats) run in their own thread there.
MONITOR_GROUPS = {"monitor": 1, "poll": 1}


class RayExecutor:
    """Owns the cluster connection and the placement groups of one run."""

    def __init__(self, cfg: Config, events: EventLog) -> None:
        ray = import_ray()
        self.owns_cluster = not ray.is_initialized() and cfg.runtime.ray.address is None
        self.ray = connect(cfg)
        # A local cluster of this run's own: reaped with the driver, however the driver ends.
        self.reaper = start_reaper() if self.owns_cluster else None
        self.cfg, self.events, self.plane = cfg, events, DataPlane()
        self._cfg_dict = config_to_dict(cfg)
        self.train_group: RayTrainGroup | None = None
        self.engine: RayEngine | None = None
        self.monitor: Monitor | None = None
        self.placement: Placement | None = None
        try:
            self.placement = place(self.ray, cfg)
        except BaseException:
            self.close()
            raise

    def start_train_group(self) -> RayTrainGroup:
        world = self.cfg.runtime.ray.train_ranks
        remote = self.ray.remote(concurrency_groups=MONITOR_GROUPS)(TrainRankActor)

        def make_ranks() -> list[Any]:
            return [remote.options(**slot.options())
                    .remote(self._cfg_dict, rank, world) for rank, slot in enumerate(self.placement.train)]

        self.train_group = RayTrainGroup(self.ray, make_ranks, events=self.events, plane=self.plane,
                                         call_timeout_s=self.cfg.runtime.ray.call_timeout_s)
        nodes = self.ray.get([r.node.remote() for r in self.train_group.ranks])
        self.events.record("actors_started", component="train group", ranks=world, pids=self.train_group.pids,
                           nodes=nodes)
        return self.train_group

    def start_engine(self, clocked: bool) -> RayEngine:
        remote = self.ray.remote(concurrency_groups=MONITOR_GROUPS)(EngineActor)
        slot = self.placement.engine

        def make_actor() -> Any:
            return remote.options(**slot.options()).remote(self._cfg_dict, clocked)

        r = self.cfg.runtime.ray
        self.engine = RayEngine(self.ray, make_actor, clocked=clocked, restarts=r.engine_restarts, events=self.events,
                                plane=self.plane, call_timeout_s=r.call_timeout_s)
        self.events.record("actors_started", component="engine", pid=self.engine.pid,
                           nodes=[self.ray.get(self.engine.node())])
        return self.engine

    def start_monitor(self) -> Monitor:
        """Heartbeats of every actor into RUN/status.json every `runtime.ray.heartbeat_s`."""
        sources = {}
        if self.train_group is not None:
            sources["train group"] = self.train_group.activity
        if self.engine is not None:
            sources["engine"] = self.engine.activity
        self.monitor = Monitor(sources, self.events, self.cfg.runtime.ray.heartbeat_s).start()
        return self.monitor

    def actor_pids(self) -> dict[str, list[int]]:
        """PIDs of the run's actors now (for tests and `axrl status`)."""
        out: dict[str, list[int]] = {}
        if self.train_group is not None:
            out["train"] = list(self.train_group.pids)
        if self.engine is not None:
            out["engine"] = [self.engine.pid]
        return out

    def close(self) -> None:
        """Release the placement groups; stop the local cluster this run started."""
        if self.monitor is not None:
            self.monitor.stop()
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
