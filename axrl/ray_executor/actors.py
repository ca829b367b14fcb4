"""The actor classes of `runtime.executor: ray`. Plain classes: `executor.py` wraps them with
`ray.remote` and the placement; they are handed settings objects and build their component with
the factories of `axrl.runtime.components`, as a local run does, so a component behaves the same
in either executor.

Every method runs under the actor's `Activity` (what it does, since when), reported by
`activity()` (`ActorBase`) in its own concurrency group, so the monitor sees a busy actor as alive.
Each backend call a train rank serves is a method of its own (`TrainRankActor.reset_optimizer`…),
so the driver's calls name the method they reach.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
from pathlib import Path
from typing import Any

import torch

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.model.device import resolve_device
from axrl.inference.embedded.settings import EngineSettings
from axrl.runtime.components import (BackendSettings, ModelSource, embedded_engine_for, initial_model,
                                     make_tokenizer, make_train_backend)
from axrl.ray_executor.activity import Activity, ActorBase, free_address, reported
from axrl.train.critic import CriticConfig, CriticUpdate
from axrl.ray_executor.handles import DataPlane, WeightsHandle, payload_bytes, rank_label
from axrl.ray_executor.trace_shards import KeptRows, fetch_engine_routing
from axrl.trace.shards import ShardInfo
from axrl.ray_executor.wire import wire_bytes
from axrl.train.protocol import (R3, AdamHyper, ForwardResult, Inspection, LossContext, LossFn, PackedBatch, StepStats,
                                 TrainMetrics)

Finished = tuple[str, GenerateResult | None, BaseException | None]   # (rid, result, error)


class EngineActor(ActorBase):
    """An embedded engine in its own process. Finished requests are collected here and handed to
    the caller with the next `step` (clocked) or `drain` (free-running) call."""

    def __init__(self, source: ModelSource, settings: EngineSettings, threads: int, clocked: bool) -> None:
        torch.set_num_threads(threads)
        tokenizer = make_tokenizer(source)
        # The initial weights; the loop loads the trainer's before the first rollout.
        self.engine = embedded_engine_for(settings, initial_model(source, tokenizer), tokenizer, clocked=clocked)
        self.activity_ = Activity("engine")
        self._cv = threading.Condition()
        self._finished: list[Finished] = []

    def _collect(self, rid: str, future: concurrent.futures.Future) -> None:
        error = future.exception()
        with self._cv:
            self._finished.append((rid, None if error else future.result(), error))
            self._cv.notify_all()
        self.activity_.count("finished_requests")

    def _take_finished(self) -> list[Finished]:
        with self._cv:
            out, self._finished = self._finished, []
        return out

    def submit_many(self, requests: list[GenerateRequest]) -> None:
        with self.activity_.doing(f"submit {len(requests)}"):
            futures = self.engine.submit_many(requests)
            for req, f in zip(requests, futures):
                f.add_done_callback(lambda f, rid=req.rid: self._collect(rid, f))

    def step(self) -> tuple[bool, list[Finished]]:
        with self.activity_.doing("step"):
            with torch.inference_mode():
                worked = self.engine.step()
            self.activity_.count("iterations")
            return worked, self._take_finished()

    def drain(self, timeout_s: float) -> list[Finished]:
        """Free-running engines: wait up to `timeout_s` for finished requests."""
        with self._cv:
            self._cv.wait_for(lambda: bool(self._finished), timeout_s)
        return self._take_finished()

    def update_weights(self, source: Any, version: int | None) -> int:
        # A state dict arrives resolved from the object store: fetched here, not by the driver.
        with self.activity_.doing(f"update_weights v{version}"):
            self.activity_.count("weight_bytes", payload_bytes(source))
            return self.engine.update_weights(source, version=version)

    def release_memory(self) -> None:
        with self.activity_.doing("release_memory"):
            self.engine.release_memory()
            self.activity_.count("memory_releases")

    def resume_memory(self) -> None:
        with self.activity_.doing("resume_memory"):
            self.engine.resume_memory()

    def abort(self, rid: str) -> tuple[bool, list[Finished]]:
        found = self.engine.abort(rid)
        return found, self._take_finished()

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def activity(self) -> list[dict[str, Any]]:
        """[This actor's heartbeat, with the engine's weight version and queue lengths]."""
        rows = super().activity()
        rows[0]["engine"] = {k: v for k, v in self.engine.health().items()
                             if k in ("weight_version", "running", "waiting")}
        return rows

    def shutdown(self) -> list[Finished]:
        self.engine.shutdown()
        return self._take_finished()


class GlobalContext:
    """A loss function normalised by the whole optimizer batch's counts while a rank computes
    only its rows: the ranks' gradients then sum to the full batch's (LossContext's contract)."""

    def __init__(self, loss_fn: LossFn, ctx: LossContext) -> None:
        self.loss_fn, self.ctx = loss_fn, ctx

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.loss_fn(logprobs, entropy, mb, self.ctx)


class TrainRankActor(ActorBase):
    """One data-parallel rank of the torch backend. Ranks start from the same seed (identical
    weights), compute their own rows, all-reduce the gradients (gloo) before each optimizer step,
    and so stay identical; rank 0 answers for the group (weights, checkpoints, exports).

    With `train.backend: megatron` there is one of these, the group's head: it holds the
    `MegatronBackend`, whose tensor/data-parallel ranks are Megatron rank actors of their own in
    `megatron_slots` (axrl/ray_executor/megatron_ranks.py)."""

    def __init__(self, source: ModelSource, backend: BackendSettings, threads: int, call_timeout_s: float,
                 rank: int, world: int, megatron_slots: list[dict[str, Any]] | None = None) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.megatron_ranks: Any = None     # the head's RayRankGroup
        self.plane = DataPlane(in_driver=False)  # what this rank puts by reference (weights, Megatron shares)
        group = None
        if megatron_slots is not None:
            from axrl.ray_executor.megatron_ranks import RayRankGroup

            def megatron_group(*args: Any) -> RayRankGroup:
                self.megatron_ranks = RayRankGroup(*args, slots=megatron_slots, plane=self.plane,
                                                   call_timeout_s=call_timeout_s)
                return self.megatron_ranks
            group = megatron_group
        self.backend = make_train_backend(source, backend, make_tokenizer(source), megatron_group=group)
        self.device = resolve_device(source.device)
        self.activity_ = Activity(rank_label(rank))
        self.kept_rows = KeptRows(rank)   # trace.sharded: routing rows held for this rank's trace shard
        self._fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-routing")

    def rendezvous(self) -> str:
        """host:port for the process group (asked of rank 0): this node's address, a free port."""
        host, port = free_address()
        return f"{host}:{port}"

    def init_group(self, address: str, timeout_s: float = 120.0) -> None:
        if self.world > 1:
            # NCCL between GPU ranks (Ray gave each its GPU: CUDA_VISIBLE_DEVICES), gloo on CPU.
            backend = "nccl" if torch.cuda.is_available() and self.device.type == "cuda" else "gloo"
            torch.distributed.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank,
                                                 world_size=self.world, timeout=datetime.timedelta(seconds=timeout_s))

    def _got(self, shard: PackedBatch) -> None:
        self.activity_.count("fetched_bytes", payload_bytes(shard))

    def fetched_bytes(self) -> int:
        return int(self.activity_.total("fetched_bytes"))

    def data_plane(self) -> dict[str, Any]:
        """This rank's account (`DataPlane.snapshot`): what it fetched and, as the Megatron head,
        what it sent its rank actors by reference and what they fetched."""
        snap = self.plane.snapshot()
        snap["rank_fetched"][rank_label(self.rank)] = self.fetched_bytes()
        if self.megatron_ranks is not None:
            snap["rank_fetched"].update(self.megatron_ranks.fetched_bytes())
        return snap

    def model_config(self) -> Any:
        return self.backend.model_config

    def forward(self, shard: PackedBatch, r3: Any, weights: str | None, keep: int | None = None,
                engine: list[Any] | None = None) -> ForwardResult:
        """The backend's forward; with `keep` (trace.sharded: the step's policy forward) the routing
        rows stay on this rank for its trace shard and the result goes back without them. `engine`:
        references to its samples' engine routing (which came past the learner), fetched in a
        thread of this rank's beside the forward and kept with its rows."""
        import ray

        with self.activity_.doing("forward"):
            self._got(shard)
            fetched = None
            if keep is not None and engine:
                fetched = self._fetcher.submit(fetch_engine_routing, ray, engine, self.activity_)
            result = self.backend.forward(shard, r3=r3, weights=weights)
            return result if keep is None else self.kept_rows.keep(keep, shard, result, fetched)

    def write_trace_shard(self, key: int, trace_dir: str, step: int, row_start: int, num_experts: int | None,
                          encoding: str, hold: tuple[int, ...] = ()) -> ShardInfo | None:
        """Write the rows kept by forward `key` as this rank's shard of trace step `step`, holding
        the forwards `hold` (the keep_full ring's); runs in the trace concurrency group, beside training."""
        with self.activity_.doing(f"trace shard {step}"):
            return self.kept_rows.write(key, trace_dir, step, row_start, num_experts, encoding, hold)

    def forward_backward(self, shard: PackedBatch, loss_fn: LossFn, r3: Any, ctx: LossContext | None) -> TrainMetrics:
        with self.activity_.doing("forward_backward"):
            self._got(shard)
            self.activity_.count("tokens", shard.num_tokens)
            return self.backend.forward_backward(shard, loss_fn if ctx is None else GlobalContext(loss_fn, ctx), r3=r3)

    def optimizer_step(self, lr: float | None, lr_scale: float, adam: AdamHyper | None = None) -> StepStats:
        with self.activity_.doing("optimizer_step"):
            if self.world > 1:
                self._all_reduce_grads()
            return self.backend.optimizer_step(lr=lr, lr_scale=lr_scale, adam=adam)

    def _all_reduce_grads(self) -> None:
        # One flat buffer: one collective per step. A parameter no token reached gets zeros (as the
        # backend itself does), so every rank contributes the same layout.
        params = [p for p in self.backend.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    # -- the backend's small calls: every rank makes the state changes, rank 0 answers questions --
    @reported
    def reset_optimizer(self) -> None:
        """The backend's `reset_optimizer`."""
        self.backend.reset_optimizer()

    @reported
    def keep_weights(self, key: str) -> None:
        """The backend's `keep_weights`: a copy of the weights now, under `key`."""
        self.backend.keep_weights(key)

    @reported
    def forget_weights(self, key: str) -> None:
        """The backend's `forget_weights`: drop the copy kept under `key`."""
        self.backend.forget_weights(key)

    @reported
    def fingerprint(self) -> str:
        """The backend's `fingerprint` of this rank's weights."""
        return self.backend.fingerprint()

    @reported
    def inspect(self, batch: PackedBatch, loss_fn: LossFn, r3: R3 = False) -> Inspection | None:
        """The backend's `inspect` of the whole `batch` (rank 0 answers for the group)."""
        return self.backend.inspect(batch, loss_fn, r3=r3)

    @reported
    def state_dict(self) -> dict[str, Any]:
        """The backend's `state_dict` (weights and optimizer state)."""
        return self.backend.state_dict()

    @reported
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The backend's `load_state_dict`."""
        self.backend.load_state_dict(state)

    @reported
    def save(self, directory: str) -> None:
        """The backend's `save` into `directory` (on this rank's node)."""
        self.backend.save(directory)

    @reported
    def load(self, directory: str) -> None:
        """The backend's `load` from `directory` (on this rank's node)."""
        self.backend.load(directory)

    @reported
    def export_hf(self, directory: str) -> Path:
        """The backend's `export_hf` into `directory`: the path it wrote."""
        return self.backend.export_hf(directory)

    # -- PPO's critic (algo.advantage: gae): every rank holds the same one and makes the same updates
    @reported
    def critic_config(self) -> tuple[CriticConfig, bool] | None:
        """(the critic's config, whether it starts from the policy), or None without a critic."""
        critic = getattr(self.backend, "critic", None)
        return None if critic is None else (critic.config, critic.from_policy)

    @reported
    def critic_values(self, batch: PackedBatch) -> torch.Tensor:
        """The critic's `values` of the whole `batch` (rank 0 answers for the group)."""
        return self.backend.critic.values(batch)

    @reported
    def critic_train(self, batch: PackedBatch, splits: list[list[int]]) -> list[CriticUpdate]:
        """The critic's `train` on the whole batch, on every rank (the critics stay identical)."""
        return self.backend.critic.train(batch, splits)

    @reported
    def critic_fingerprint(self) -> str:
        """The critic's weights fingerprint."""
        return self.backend.critic.fingerprint()

    @reported
    def critic_copy_policy(self) -> None:
        """Start the critic from this rank's policy weights (`Critic.copy_policy`)."""
        self.backend.critic.copy_policy(self.backend.sync_source())

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.backend.named_weights()}

    def put_weights(self, version: int | None) -> list[WeightsHandle]:
        """A snapshot of the weights in the object store, owned by this rank (list: the handle's
        ref travels to the driver as a reference, not as the weights)."""
        import ray

        with self.activity_.doing("put_weights"):
            weights = self.named_weights()
            ref, nbytes = ray.put(weights), wire_bytes(weights)
            self.plane.by_reference("weights", nbytes)   # once per snapshot, however many fetch it
            return [WeightsHandle(ref, version, nbytes)]

    def activity(self) -> list[dict[str, Any]]:
        """This rank's heartbeat (and, as the Megatron head, its rank actors')."""
        rows = super().activity()
        if self.megatron_ranks is not None:
            rows += self.megatron_ranks.activity()
        return rows

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.backend.close()
