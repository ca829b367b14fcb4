"""`trace.sharded` under the Ray executor: each train rank writes the routing rows it holds.

A MoE step's payload is its routing: the engine's (which the ranks receive with their samples,
for R3) and the trainer's (which they compute), 2·L·k bytes a token against a few tens for every
other column together. With sharding on, the step's policy forward (the old logprobs) keeps
both on each rank (`KeptRows`) and returns the learner its logprobs and entropy without the
trainer's routing; when the learner's background writer reaches the step, each rank writes its
rows into ``trace/step_N.shards/train_rankR.h5`` (in its own thread: the "trace" concurrency
group, beside training) and the learner writes the index (`RankShards`; axrl/trace/shards.py).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import torch

from axrl.trace.record import StepRecord
from axrl.trace.shards import ShardInfo, routing_rows, write_shard, write_sharded_step
from axrl.train.protocol import ForwardResult, PackedBatch

#: The Ray concurrency group a rank writes its shards in (beside the default group that trains).
TRACE_GROUP = "trace"
_KEEP_AT_MOST = 16   # forwards held on a rank unwritten (the learner writes each step's; a lost one is dropped)


class KeptRows:
    """A rank's side: the routing rows of the policy forwards it was asked to keep, by key, until
    the learner has them written (thread-safe: kept while training, written in the trace group)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self._lock = threading.Lock()

    def keep(self, key: int, shard: PackedBatch, result: ForwardResult) -> ForwardResult:
        """Hold `shard`'s rollout routing and `result`'s trainer routing; `result` without the latter
        (it stays here: the learner needs only the logprobs and entropy)."""
        with self._lock:
            self._rows[key] = (shard.offsets, shard.routed_experts, result.routed_experts)
            for old in sorted(self._rows)[:-_KEEP_AT_MOST]:
                del self._rows[old]
        return dataclasses.replace(result, routed_experts=None)

    def write(self, key: int, trace_dir: str, step: int, row_start: int, num_experts: int | None,
              encoding: str = "raw") -> ShardInfo | None:
        """Write the rows kept under `key` as this rank's shard of `step` in routing `encoding`
        (None: no routing held, or `num_experts` None: the step records none); forgets them and
        any older ones."""
        with self._lock:
            if key not in self._rows:
                raise KeyError(f"train rank {self.rank} holds no rows for step {step} (forward {key}): "
                               "was the train group restarted since?")
            offsets, rollout, train = self._rows.pop(key)
            for old in [k for k in self._rows if k < key]:
                del self._rows[old]
        if num_experts is None or (rollout is None and train is None):
            return None
        rows, attrs = routing_rows(None if rollout is None else rollout.numpy(),
                                   None if train is None else train.numpy(), offsets.numpy(), num_experts, encoding)
        return write_shard(trace_dir, step, f"train_rank{self.rank}", row_start, row_start + int(offsets[-1]),
                           rows, attrs)


class RankShards:
    """The learner's side (`StepShards`): which kept forward is which step's, and the step's write:
    every rank's shard (in parallel, each in its own process), then the index."""

    def __init__(self, group: Any, trace_dir: Path, encoding: str = "raw") -> None:
        self.group, self.trace_dir, self.encoding = group, trace_dir, encoding
        group.keep_trace_rows = True
        self._claimed: dict[int, tuple[int, list[int]]] = {}   # step -> (forward key, row start per rank)

    def claim(self, step: int) -> None:
        kept = self.group.last_kept
        if kept is None:
            raise RuntimeError(f"step {step}: the train group kept no policy forward to record")
        self._claimed[step] = kept

    def write(self, record: StepRecord) -> Path:
        """The ranks write their shards (none when the step's record carries no routing, as on
        `trace.level: standard`'s steps between `routing_every`: they drop their rows), then the index."""
        key, starts = self._claimed.pop(record.step)
        routed = record.routing_rollout is not None or record.routing_train is not None
        infos = self.group.write_trace_shards(key, str(self.trace_dir), record.step, starts,
                                              record.num_experts if routed else None, self.encoding)
        shards = [i for i in infos if i is not None]
        if shards:
            record = dataclasses.replace(record, routing_rollout=None, routing_rollout_valid=None, routing_train=None)
        return write_sharded_step(self.trace_dir, record, shards)
