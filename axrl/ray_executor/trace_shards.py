"""`trace.sharded` under the Ray executor: each train rank writes the routing rows it holds.

A MoE step's payload is its routing: the engine's (which the ranks receive with their samples,
or by reference) and the trainer's (which they compute), 2·L·k bytes a token against a few tens for every
other column together. With sharding on, the step's policy forward (the old logprobs) keeps
both on each rank (`KeptRows`) and returns the learner its logprobs and entropy without the
trainer's routing; when the learner's background writer reaches the step, each rank writes its
rows into ``trace/step_N.shards/train_rankR.h5`` (in its own thread: the "trace" concurrency
group, beside training) and the learner writes the index (`RankShards`; axrl/trace/shards.py).

With a `trace.keep_full` ring (axrl/runtime/recording/tiers.py) a step is first written reduced, and its
rows must survive until it leaves the ring or a spike promotes it: the ranks hold the rows of the
ring's steps (`hold`: the learner says which after every write) and write them as the promoted
step's shards, which the learner's full index then replaces the reduced one over. The ring's
memory is spread over the ranks, each holding its own rows of K steps.

The engine's routing (`engine_routing_by_reference`: when training does not need it in the
batch — no R3, no dynamic sampling whose dropped samples the learner records whole) never passes
through the learner either: the rollout actor puts each trajectory's rows in the object store on
their own and hands over the batch with only the references (`put_engine_routing`); the learner
hands them to the train group (`RankShards.batch`), which passes each rank those of its samples
with its share of the step's policy forward, and the rank fetches them in a thread of its own
beside that forward, early, so that a rollout actor dying later does not take them along. The learner's process holds the step's token columns (it builds the training batch from
them) and object references; the routing, 2·L·k bytes a token, only ever lives on the rollout
actor (which generated it) and on the rank that writes it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from axrl.runtime.recording.tiers import ATTR_PROMOTED_BY, ATTR_TRACE_LEVEL, TierSettings, writes_routing
from axrl.trace.step_record import StepRecord
from axrl.trace.shards import ShardInfo, routing_rows, write_shard, write_sharded_step
from axrl.train.protocol import ForwardResult, PackedBatch

#: The Ray concurrency group a rank writes its shards in (beside the default group that trains).
TRACE_GROUP = "trace"
_KEEP_AT_MOST = 16   # forwards held on a rank unwritten, besides the ring's (a lost one is dropped)
_REDUCED = ("standard", "summary")
#: Trajectory.info key of the object reference to its engine routing (`put_engine_routing`).
ROUTING_REF = "axrl_engine_routing_ref"


def engine_routing_by_reference(learner: Any) -> bool:
    """Whether the rollout actor sends the engine's routing by reference past the learner
    (`learner`: the run's `LearnerSettings`): sharded, and training needs no routing in its batch —
    no R3 (the ranks replay it from the batch) and no dynamic sampling (the learner records its
    dropped samples' routing in /pool)."""
    r = learner.record
    return bool(r.sharded and r.trace and r.routing and not learner.step.r3 and learner.keep_groups is None)


def put_engine_routing(ray: Any, trajectories: list[Any]) -> int:
    """The rollout actor's side: each trajectory's engine routing put in the object store on its
    own (a rank fetches only its samples'), the trajectory keeping the reference in `info`; the
    bytes put. The rollout actor owns the objects (as it owns the batch): one that dies before the
    ranks fetched them — during the step's policy forward — takes them along (`fetch_engine_routing`
    says so)."""
    put = 0
    for t in trajectories:
        if t.routed_experts is not None:
            rows = np.ascontiguousarray(t.routed_experts)
            t.info[ROUTING_REF], t.routed_experts = ray.put(rows), None
            put += int(rows.nbytes)
    return put


def engine_references(trajectories: list[Any]) -> list[Any] | None:
    """The `ROUTING_REF` of each trajectory, in order (None unless every one has one)."""
    refs = [t.info.get(ROUTING_REF) for t in trajectories]
    return refs if refs and all(r is not None for r in refs) else None


def fetch_engine_routing(ray: Any, refs: list[Any], activity: Any = None) -> np.ndarray:
    """A rank's side: its samples' engine routing rows, fetched from `refs` (in sample order);
    counted in `activity`'s fetched bytes."""
    try:
        rows = np.concatenate(ray.get(list(refs)))
    except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as e:
        raise RuntimeError(f"the engine routing of the step's samples was lost with the rollout actor that "
                           f"produced it (it died before this train rank fetched it; {type(e).__name__})") from None
    if activity is not None:
        activity.count("fetched_bytes", int(rows.nbytes))
    return rows


class KeptRows:
    """A rank's side: the routing rows of the policy forwards it was asked to keep, by key, until
    the learner has them written (thread-safe: kept while training, written in the trace group)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # key -> (offsets, the engine's routing: from the batch, or a future of it fetched by
        # reference; the trainer's routing)
        self._rows: dict[int, tuple[torch.Tensor, Any, torch.Tensor | None]] = {}
        self._held: set[int] = set()   # the keep_full ring's forwards: kept until the learner lets go
        self._lock = threading.Lock()

    def keep(self, key: int, shard: PackedBatch, result: ForwardResult,
             engine: concurrent.futures.Future | None = None) -> ForwardResult:
        """Hold `shard`'s rollout routing (or `engine`'s, fetched by reference) and `result`'s
        trainer routing; `result` without the latter (it stays here: the learner needs only the
        logprobs and entropy)."""
        with self._lock:
            self._rows[key] = (shard.offsets, shard.routed_experts if engine is None else engine, result.routed_experts)
            for old in sorted(k for k in self._rows if k not in self._held)[:-_KEEP_AT_MOST]:
                del self._rows[old]
        return dataclasses.replace(result, routed_experts=None)

    def write(self, key: int, trace_dir: str, step: int, row_start: int, num_experts: int | None,
              encoding: str = "raw", hold: tuple[int, ...] = ()) -> ShardInfo | None:
        """Write the rows kept under `key` as this rank's shard of `step` in routing `encoding`
        (None: no routing held, or `num_experts` None: the step records none); forgets them and
        any older ones, except the forwards in `hold` (the keep_full ring's, `key` among them when
        its step may yet be promoted)."""
        with self._lock:
            if key not in self._rows:
                raise KeyError(f"train rank {self.rank} holds no rows for step {step} (forward {key}): "
                               "was the train group restarted since?")
            self._held = set(hold)
            offsets, rollout, train = self._rows[key] if key in self._held else self._rows.pop(key)
            for old in [k for k in self._rows if k < key and k not in self._held]:
                del self._rows[old]
        if isinstance(rollout, concurrent.futures.Future):   # fetched by reference beside the forward
            engine_rows = rollout.result()
            if len(engine_rows) != int(offsets[-1]):
                raise ValueError(f"train rank {self.rank}, step {step}: {len(engine_rows)} engine routing rows "
                                 f"for its {int(offsets[-1])} tokens")
        else:
            engine_rows = None if rollout is None else rollout.numpy()
        if num_experts is None or (engine_rows is None and train is None):
            return None
        rows, attrs = routing_rows(engine_rows,
                                   None if train is None else train.numpy(), offsets.numpy(), num_experts, encoding)
        return write_shard(trace_dir, step, f"train_rank{self.rank}", row_start, row_start + int(offsets[-1]),
                           rows, attrs)


class RankShards:
    """The learner's side (`StepShards`): which kept forward is which step's, and the step's write:
    every rank's shard (in parallel, each in its own process), then the index. The learner's
    records carry no routing (`strip`): whether a write has any is the tiers' rule."""

    def __init__(self, group: Any, trace_dir: Path, encoding: str = "raw", tiers: TierSettings | None = None) -> None:
        self.group, self.trace_dir, self.encoding = group, trace_dir, encoding
        self.tiers = tiers or TierSettings()
        group.keep_trace_rows = True
        self._claimed: dict[int, tuple[int, list[int]]] = {}   # step -> (forward key, row start per rank)
        self._ring: collections.deque[int] = collections.deque()   # steps written reduced, rows still held

    @staticmethod
    def strip(record: StepRecord) -> StepRecord:
        """`record` without the routing the ranks hold (what the learner queues and rings)."""
        return dataclasses.replace(record, routing_rollout=None, routing_rollout_valid=None, routing_train=None)

    def batch(self, trajectories: list[Any]) -> None:
        """The next step trains `trajectories` (in batch order): the train group hands each rank
        the references to its samples' engine routing, when it came by reference."""
        self.group.engine_routing = engine_references(trajectories)

    def claim(self, step: int) -> None:
        kept = self.group.last_kept
        if kept is None:
            raise RuntimeError(f"step {step}: the train group kept no policy forward to record")
        self._claimed[step] = kept

    def write(self, record: StepRecord) -> Path:
        """The ranks write their shards (none when the step's record carries no routing, as on
        `trace.level: standard`'s steps between `routing_every`), then the index. A reduced step
        joins the keep_full ring (its rows stay on the ranks, the oldest step's are let go); a
        full one (promoted by a spike, or the spike step) leaves it and replaces its reduced file."""
        key, starts = self._claimed[record.step]
        hold = self._ring_after(record)
        routed = writes_routing(record, self.tiers)   # the learner's record carries none: the ranks hold it
        infos = self.group.write_trace_shards(key, str(self.trace_dir), record.step, starts,
                                              record.num_experts if routed else None, self.encoding, hold)
        shards = [i for i in infos if i is not None]
        return write_sharded_step(self.trace_dir, self.strip(record), shards, overwrite=ATTR_PROMOTED_BY in record.attrs)

    def _ring_after(self, record: StepRecord) -> tuple[int, ...]:
        """Update the ring for `record`'s write; the forward keys the ranks must hold after it."""
        step = record.step
        if self.tiers.keep_full and record.attrs.get(ATTR_TRACE_LEVEL) in _REDUCED:
            self._ring.append(step)
            while len(self._ring) > self.tiers.keep_full:
                del self._claimed[self._ring.popleft()]
        else:
            if step in self._ring:
                self._ring.remove(step)
            del self._claimed[step]
        return tuple(self._claimed[s][0] for s in self._ring)
