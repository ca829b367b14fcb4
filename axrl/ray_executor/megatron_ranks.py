"""The Megatron backend's ranks as Ray actors: `RayRankGroup` replaces the worker processes that
`axrl/train/megatron/parallel.py` launches itself, under `runtime.executor: ray`.

It is a `RankGroup` (`axrl/train/megatron/parallel.py`), like the backend's own worker
processes, so `MegatronBackend` runs unchanged on top of it. Each rank is a `MegatronRankActor` in
its placement slot; they form their gloo (NCCL on GPUs) process group at rank 0's node address,
and every call goes to all ranks at once (collectives need them all), failing fast when one fails.
The backend itself lives in the train group's head actor (`TrainRankActor`), so the driver and
the learner reach it like a torch rank.

Batches move by handle: the backend hands `call_each` one `RankWork` per rank (its DP share of
every micro-batch, `shares.py`); each distinct one goes into the object store once and only its
reference is sent, so a rank fetches its own rows and the TP ranks of one DP rank share one object.
"""

from __future__ import annotations

from typing import Any, Callable

from axrl.model import ModelConfig
from axrl.ray_executor.activity import Activity, ActorBase, free_address
from axrl.ray_executor.calls import close_actor
from axrl.ray_executor.handles import DataPlane, payload_bytes, rank_label
from axrl.ray_executor.wire import wire_bytes
from axrl.train.megatron.model import ParallelSizes
from axrl.train.megatron.rank_calls import RankCall


class MegatronRankActor(ActorBase):
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.activity_ = Activity(rank_label(rank, "megatron"))
        self.state: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port) for the process group (asked of rank 0)."""
        return free_address()

    def init(self, host: str, port: int, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str,
             weights: dict[str, Any], seed: int, num_threads: int) -> None:
        from axrl.train.megatron.rank import MegatronRank, init_distributed, worker_setup

        with self.activity_.doing("init"):
            worker_setup(seed, num_threads)
            init_distributed(self.rank, self.world, port, sizes, seed, host=host)
            self.state = MegatronRank(model_cfg, sizes, dispatcher, weights)

    def call(self, call: RankCall) -> Any:
        """Run a typed call (`rank_calls.py`) on this rank."""
        with self.activity_.doing(call.name):
            return call.run(self.state)

    def call_with(self, first: Any, call: RankCall) -> Any:
        """`call` with this rank's own first argument (resolved from its object reference)."""
        self.activity_.count("fetched_bytes", payload_bytes(first))
        with self.activity_.doing(call.name):
            return call.run(self.state, first)

    def fetched_bytes(self) -> int:
        return int(self.activity_.total("fetched_bytes"))

    def close(self) -> None:
        import torch.distributed as dist

        if self.state is not None:
            self.state.release()
        if dist.is_initialized():
            dist.destroy_process_group()


class RayRankGroup:
    """`sizes.world_size` Megatron rank actors, one per entry of `slots` (Ray actor options).
    What each rank is sent by reference is counted in `plane` (the head actor's account)."""

    def __init__(self, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str, weights: dict[str, Any],
                 seed: int, num_threads: int, *, slots: list[dict[str, Any]], call_timeout_s: float,
                 plane: DataPlane | None = None) -> None:
        import ray

        if len(slots) != sizes.world_size:
            raise ValueError(f"{len(slots)} placement slots for a Megatron world of {sizes.world_size} ranks")
        self._ray, self._timeout, self.world_size = ray, call_timeout_s, sizes.world_size
        self._plane = plane or DataPlane(in_driver=False)
        remote = ray.remote(concurrency_groups={"monitor": 1})(MegatronRankActor)
        self.actors = [remote.options(**slot).remote(r, self.world_size) for r, slot in enumerate(slots)]
        self._closed = False
        try:
            self.pids = self._collect([a.pid.remote() for a in self.actors], "start-up")
            host, port = self._collect([self.actors[0].rendezvous.remote()], "rendezvous")[0]
            ref = ray.put(weights)  # once in the object store; every rank reads it from there
            self._collect([a.init.remote(host, port, model_cfg, sizes, dispatcher, ref, seed, num_threads)
                           for a in self.actors], "init")
        except BaseException:
            self.close()
            raise

    def _collect(self, refs: list[Any], what: str) -> list[Any]:
        """Every rank's answer; the first failure is raised at once (the others may be waiting in
        a collective for the failed rank)."""
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=self._timeout)
            if not ready:
                raise TimeoutError(f"Megatron rank actor(s) gave no answer to {what} within {self._timeout:g} s "
                                   "(runtime.ray.call_timeout_s)")
            self._ray.get(ready)
        return self._ray.get(refs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank runs the `MegatronRank` method `fn(rank, *args, **kwargs)`, checked here (small
        arguments; weights go into the object store once and every rank reads them from there)."""
        call = RankCall.of(fn, *args, **kwargs)
        self._check_open()
        ref = self._ray.put(call)
        return self._collect([a.call.remote(ref) for a in self.actors], call.name)

    def call_each(self, fn: Callable[..., Any], firsts: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Rank r runs `fn(rank, firsts[r], *args, **kwargs)`; each distinct first argument is put in
        the object store once and rank r is sent only the reference to its own."""
        call = RankCall.each(fn, firsts[0], *args, **kwargs)
        self._check_open()
        refs: dict[int, tuple[Any, int]] = {}   # id → (object ref, its payload bytes)
        for obj in firsts:
            if id(obj) not in refs:
                refs[id(obj)] = (self._ray.put(obj), payload_bytes(obj))
                self._plane.by_reference("megatron_shares", wire_bytes(obj))
        for r, obj in enumerate(firsts):
            self._plane.shared(rank_label(r, "megatron"), refs[id(obj)][1])
        rest = self._ray.put(call)
        return self._collect([a.call_with.remote(refs[id(obj)][0], rest)
                              for a, obj in zip(self.actors, firsts)], call.name)

    def fetched_bytes(self, timeout_s: float = 30.0) -> dict[str, int]:
        """What each rank says it fetched, by label."""
        got = self._ray.get([a.fetched_bytes.options(concurrency_group="monitor").remote() for a in self.actors],
                            timeout=timeout_s)
        return {rank_label(r, "megatron"): n for r, n in enumerate(got)}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Megatron backend's rank actors are closed")

    def activity(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Every rank actor's heartbeat, in rank order."""
        per_rank = self._ray.get([a.activity.options(concurrency_group="monitor").remote() for a in self.actors],
                                 timeout=timeout_s)
        return [row for rows in per_rank for row in rows]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self.actors:
            close_actor(self._ray, a)
