"""RayTrainGroup: the `TrainBackend` protocol over N data-parallel torch ranks, one actor each.

Each call shards the packed batch by samples (contiguous, balanced by tokens), puts every shard
in the object store once and sends each rank only the reference to its own shard; per-token
outputs come back in rank order, which is batch order. `forward_backward` hands every rank the
whole batch's `LossContext`, so the ranks' gradients sum to the full batch's; `optimizer_step`
all-reduces them inside the group (gloo), so the ranks stay identical and rank 0 answers for
the group. With one rank every call is the in-process backend's own call on the same batch —
the same bits as `runtime.executor: local`.

A dead rank fails the call with `TrainGroupLost`; `recovery.py` restarts the run from its last
checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from axrl.model.config import ModelConfig
from axrl.runtime.recording.events import EventLog
from axrl.ray_executor.calls import close_actor
from axrl.ray_executor.handles import DataPlane, WeightsHandle, payload_bytes, rank_label, shard_rows
from axrl.ray_executor.trace_shards import TRACE_GROUP
from axrl.ray_executor.wire import wire_bytes
from axrl.train.critic import CriticConfig, CriticUpdate
from axrl.train.metrics import reduce_microbatch_metrics
from axrl.train.protocol import (R3, AdamHyper, ForwardResult, Inspection, LossContext, LossFn, PackedBatch, StepStats,
                                 TrainMetrics)


class TrainGroupLost(RuntimeError):
    """A train rank died; the group's state is gone (restart from a checkpoint)."""


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]


class RemoteCritic:
    """PPO's critic (`axrl.train.critic.Critic`) held by the train ranks: the calls `train_critic`
    and the step trainer make, forwarded. Every rank trains it on the whole batch (no gradient
    all-reduce), so the ranks' critics stay identical; rank 0 answers questions."""

    def __init__(self, group: "RayTrainGroup", config: CriticConfig, from_policy: bool) -> None:
        self.group, self.config, self.from_policy = group, config, from_policy

    def values(self, batch: PackedBatch) -> torch.Tensor:
        return self.group._get(self.group.ranks[0].critic_values.remote(batch))

    def train(self, batch: PackedBatch, splits: list[list[int]]) -> list[CriticUpdate]:
        ref = self.group._ray.put(batch)
        return self.group._each(lambda r: r.critic_train.remote(ref, [list(s) for s in splits]))[0]

    def fingerprint(self) -> str:
        return self.group._get(self.group.ranks[0].critic_fingerprint.remote())

    def copy_policy(self, weights: object = None) -> None:
        """Each rank copies its own policy's weights (`weights`, the driver's handle, is not needed)."""
        self.group._each(lambda r: r.critic_copy_policy.remote())


class RayTrainGroup:
    """A `TrainBackend` over train rank actors. The driver's group owns the ranks (`start`: it
    creates them and forms their process group, and closing it kills them); the learner actor
    attaches its own group to the same ranks (`attach`), to train without the driver."""

    loss_in_process = False   # the loss runs on the ranks: the spike trigger marks spikes without its dump

    def __init__(self, ray: Any, ranks: list[Any], *, model_config: ModelConfig, pids: list[int], events: EventLog,
                 plane: DataPlane, call_timeout_s: float = 600.0, owner: bool = True) -> None:
        self._ray, self._events, self._plane, self._timeout = ray, events, plane, call_timeout_s
        self.ranks, self.world, self.pids, self.owner = ranks, len(ranks), pids, owner
        self._model_config = model_config
        self._critic: tuple[CriticConfig, bool] | None = None   # the ranks' critic (config, from_policy)
        self.critic: RemoteCritic | None = None                 # PPO's critic on the ranks (algo.advantage: gae)
        self.lost = False
        self._closed = False
        # trace.sharded (trace_shards.py): the policy forwards' routing rows stay on the ranks, each
        # under a key; last_kept = (key, first token row of each rank's share) of the latest one;
        # engine_routing: the references to the current batch's engine routing, one per sample (None:
        # it comes with the batch), handed to the ranks with their shares of the policy forward
        self.keep_trace_rows = False
        self.last_kept: tuple[int, list[int]] | None = None
        self.engine_routing: list[Any] | None = None
        self._kept_count = 0

    @classmethod
    def start(cls, ray: Any, make_ranks: Callable[[], list[Any]], *, events: EventLog, plane: DataPlane,
              call_timeout_s: float = 600.0) -> "RayTrainGroup":
        """Create the ranks and form their gloo process group."""
        group = cls(ray, make_ranks(), model_config=None, pids=[], events=events, plane=plane,  # type: ignore[arg-type]
                    call_timeout_s=call_timeout_s)
        group.pids = group._each(lambda r: r.pid.remote())
        if group.world > 1:
            address = group._get(group.ranks[0].rendezvous.remote())
            group._each(lambda r: r.init_group.remote(address))
        group._model_config = group._get(group.ranks[0].model_config.remote())
        group._critic = group._get(group.ranks[0].critic_config.remote())
        group.critic = None if group._critic is None else RemoteCritic(group, *group._critic)
        return group

    def attachment(self) -> dict[str, Any]:
        """What `attach` needs in another process (actor handles and small facts only)."""
        return {"ranks": self.ranks, "model_config": self._model_config, "pids": self.pids, "critic": self._critic}

    @classmethod
    def attach(cls, ray: Any, attachment: dict[str, Any], *, events: EventLog, plane: DataPlane,
               call_timeout_s: float = 600.0) -> "RayTrainGroup":
        """A group over ranks another process owns; closing it leaves them running."""
        group = cls(ray, list(attachment["ranks"]), model_config=attachment["model_config"], pids=attachment["pids"],
                    events=events, plane=plane, call_timeout_s=call_timeout_s, owner=False)
        group._critic = attachment.get("critic")
        group.critic = None if group._critic is None else RemoteCritic(group, *group._critic)
        return group

    # -- calls -----------------------------------------------------------------------------------
    def _get(self, refs: Any) -> Any:
        """Results of one call or of one call per rank, failing fast: when a rank dies the others
        may be blocked in a collective with it, so its error is raised as soon as it is known."""
        ex = self._ray.exceptions
        try:
            if not isinstance(refs, list):
                return self._ray.get(refs, timeout=self._timeout)
            pending = list(refs)
            while pending:
                ready, pending = self._ray.wait(pending, num_returns=1, timeout=self._timeout)
                if not ready:
                    raise ex.GetTimeoutError(f"no train rank answered within {self._timeout} s "
                                             "(runtime.ray.call_timeout_s)")
                self._ray.get(ready)  # raises the rank's error
            return self._ray.get(refs)
        except (ex.RayActorError, ex.ActorUnavailableError, ex.GetTimeoutError) as e:
            self.lost = True
            self._events.record("actor_failed", component="train group", pids=self.pids,
                                reason=f"{type(e).__name__}: {str(e)[:200]}")
            raise TrainGroupLost(f"a train rank died ({type(e).__name__}); the train group restarts from the last "
                                 "checkpoint (runtime.ray.train_restarts)") from e

    def _each(self, call: Callable[[Any], Any]) -> list[Any]:
        """Every rank's answer to `call(rank)` (which starts one remote call on that rank), in
        rank order. State changes go to every rank, so the ranks stay identical."""
        return self._get([call(r) for r in self.ranks])

    def _shards(self, batch: PackedBatch) -> list[tuple[Any, PackedBatch]]:
        """(object ref, shard) per rank; the whole batch as one shard on a single rank."""
        if self.world == 1:
            shards = [batch]
        else:
            rows = shard_rows(batch, self.world)
            if any(not r for r in rows):
                raise ValueError(f"a batch of {batch.num_samples} samples cannot give each of the "
                                 f"{self.world} train ranks (runtime.ray.train_ranks) a sample")
            shards = [batch.select(r) for r in rows]
        out = []
        for i, s in enumerate(shards):
            self._plane.shared(rank_label(i), payload_bytes(s))
            ref = self._ray.put(s)
            self._plane.by_reference("batch", wire_bytes(s))
            out.append((ref, s))
        return out

    # -- TrainBackend ----------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    def forward(self, batch: PackedBatch, *, r3: R3 = False, weights: str | None = None) -> ForwardResult:
        shards = self._shards(batch)
        keep = None
        if self.keep_trace_rows and weights is None:   # the policy's own forward: its rows are the step's trace
            self._kept_count += 1
            keep = self._kept_count
            starts = [0]
            for _, s in shards[:-1]:
                starts.append(starts[-1] + s.num_tokens)
            self.last_kept = (keep, starts)
        engine = self._engine_shares([s for _, s in shards]) if keep is not None else [None] * len(shards)
        parts: list[ForwardResult] = self._get([r.forward.remote(ref, r3, weights, keep, refs)
                                                for r, (ref, _), refs in zip(self.ranks, shards, engine)])
        self._plane.moved("forward_results", sum(payload_bytes(p) for p in parts))
        if len(parts) == 1:
            return parts[0]
        return ForwardResult(logprobs=torch.cat([p.logprobs for p in parts]),
                             entropy=torch.cat([p.entropy for p in parts]),
                             routed_experts=_cat([p.routed_experts for p in parts]))

    def _engine_shares(self, shards: list[PackedBatch]) -> list[list[Any] | None]:
        """Each rank's references of `engine_routing`: its share's samples' (shares are contiguous
        runs of the batch's samples, in order)."""
        refs = self.engine_routing
        if refs is None:
            return [None] * len(shards)
        if len(refs) != sum(s.num_samples for s in shards):
            raise ValueError(f"{len(refs)} engine routing references for a batch of "
                             f"{sum(s.num_samples for s in shards)} samples")
        bounds = np.cumsum([0, *(s.num_samples for s in shards)]).tolist()
        return [refs[a:b] for a, b in zip(bounds, bounds[1:])]

    def forward_backward(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> TrainMetrics:
        shards = self._shards(batch)
        ctx = None if self.world == 1 else LossContext.of(batch)
        parts: list[TrainMetrics] = self._get([r.forward_backward.remote(ref, loss_fn, r3, ctx)
                                               for r, (ref, _) in zip(self.ranks, shards)])
        self._plane.moved("train_metrics", sum(payload_bytes(p) for p in parts))
        if len(parts) == 1:
            return parts[0]
        rows = [row for p in parts for row in p.micro_batches]
        keys = set().union(*(p.tokens for p in parts))
        tokens = {k: torch.cat([p.tokens[k] for p in parts]) for k in keys if all(k in p.tokens for p in parts)}
        return TrainMetrics(loss=sum(r["loss"] for r in rows), micro_batches=rows,
                            metrics={**reduce_microbatch_metrics(rows), "num_micro_batches": float(len(rows))},
                            tokens=tokens)

    def write_trace_shards(self, key: int, trace_dir: str, step: int, starts: list[int],
                           num_experts: int | None, encoding: str, hold: tuple[int, ...] = ()) -> list[Any]:
        """Every rank writes the rows it kept from forward `key` as its shard of `step`, in parallel
        and beside training, still holding the forwards `hold` (trace_shards.py); their
        `ShardInfo`s (None: a rank wrote none)."""
        return self._get([r.write_trace_shard.options(concurrency_group=TRACE_GROUP).remote(
            key, trace_dir, step, start, num_experts, encoding, hold) for r, start in zip(self.ranks, starts)])

    def optimizer_step(self, *, lr: float | None = None, lr_scale: float = 1.0,
                       adam: AdamHyper | None = None) -> StepStats:
        return self._each(lambda r: r.optimizer_step.remote(lr, lr_scale, adam))[0]

    def reset_optimizer(self) -> None:
        self._each(lambda r: r.reset_optimizer.remote())

    def keep_weights(self, key: str) -> None:
        self._each(lambda r: r.keep_weights.remote(key))

    def forget_weights(self, key: str) -> None:
        self._each(lambda r: r.forget_weights.remote(key))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        weights = self._get(self.ranks[0].named_weights.remote())
        self._plane.moved("weights_to_driver", payload_bytes(weights))
        return iter(weights.items())

    def sync_source(self) -> WeightsHandle:
        """A snapshot in rank 0's object store: the engines fetch it, the driver only sees the handle."""
        return self._get(self.ranks[0].put_weights.remote(None))[0]

    def fingerprint(self) -> str:
        return self._get(self.ranks[0].fingerprint.remote())

    def fingerprints(self) -> list[str]:
        """Every rank's fingerprint (equal while the group is healthy)."""
        return self._each(lambda r: r.fingerprint.remote())

    def inspect(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> Inspection | None:
        return self._get(self.ranks[0].inspect.remote(batch, loss_fn, r3))

    def probe_forward(self, batch: PackedBatch, probe: Any, *, r3: R3 = False) -> ForwardResult | None:
        """None: a probe observes and patches the model in its own process, and the model lives
        in the ranks (replay, which probes, builds an in-process backend)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return self._get(self.ranks[0].state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._each(lambda r: r.load_state_dict.remote(state))

    def save(self, directory: str | Path) -> None:
        # The ranks are identical: rank 0 writes (on its node's disk: the run directory must be shared).
        self._get(self.ranks[0].save.remote(str(directory)))

    def load(self, directory: str | Path) -> None:
        self._each(lambda r: r.load.remote(str(directory)))

    def export_hf(self, directory: str | Path) -> Path:
        return Path(self._get(self.ranks[0].export_hf.remote(str(directory))))

    def activity(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Every rank's heartbeat (answered by its monitor thread even while it trains)."""
        per_rank = self._ray.get([r.activity.options(concurrency_group="monitor").remote() for r in self.ranks],
                                 timeout=timeout_s)
        return [row for rows in per_rank for row in rows]

    def fetched_bytes(self) -> list[int]:
        return self._each(lambda r: r.fetched_bytes.remote())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.owner:
            return
        if not self.lost:
            try:
                for snapshot in self._ray.get([r.data_plane.remote() for r in self.ranks], timeout=30):
                    self._plane.merge(snapshot)
            except Exception:  # noqa: BLE001 — accounting only
                pass
        for r in self.ranks:
            # Survivors of a lost group may be stuck in a collective: just kill them.
            close_actor(self._ray, r, ask=not self.lost)
