"""Learner: the step's data path after the pool — train on the sealed batch, then record it.

A sealed batch in, the step's metrics out: the train worker's step (advantages, old logprobs,
updates, weight post), the metrics.jsonl line, the online spike trigger and the step's trace
file. The loop hands it the batch and gets back only the metrics, so the heavy parts of a step
(trajectories, the packed batch, per-token trainer outputs) never need to be where the loop
is: under `runtime.executor: ray` this same object runs in an actor next to the train ranks
(`axrl/ray_executor/learner.py`) and the driver passes it an object reference.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from axrl.rollout.pool import Batch
from axrl.console.progress import PhaseTimer
from axrl.runtime.recording.builders import step_metrics, step_record
from axrl.runtime.recording.step_writer import StepWriter
from axrl.runtime.recording.tiers import ATTR_PROMOTED_BY, TieredRecords, TierSettings
from axrl.runtime.spike_trigger import SpikeSettings, SpikeTrigger
from axrl.runtime.step_trainer import StepTrainer
from axrl.trace import RunDir, StepRecord


def rng_digest() -> str:
    """Digest of this process' torch RNG state (recorded per step)."""
    return hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).hexdigest()


class StepLearner(Protocol):
    """What the loop needs of a learner (in-process, or the Ray actor's driver-side handle)."""

    def step(self, batch: Any, step: int, timer: PhaseTimer) -> dict[str, Any]:
        """Train on `batch` (sealed batch `step`, or a reference to it), record it; the metrics."""

    def flush(self) -> None:
        """Return once every step recorded so far is on disk (before a checkpoint)."""

    def close(self) -> None:
        """Write what is still queued and stop recording."""

    def written_through(self) -> float:
        """The latest step whose trace file is on disk (-1: none yet; inf: the trace is off)."""


@dataclass(frozen=True)
class RecordSettings:
    """What the learner records of each step: the trace file (with routing or not) and the
    online spike trigger's deep dumps."""

    trace: bool = True
    routing: bool = True
    spike: SpikeSettings = field(default_factory=SpikeSettings)
    write_queue: int = 2        # step files written in the background, at most this many queued (0: in the step)
    routing_encoding: str = "raw"   # "packed": routing bit-packed on disk (axrl/trace/routing_codec.py)
    tiers: TierSettings = field(default_factory=TierSettings)   # trace.level / routing_every / keep_full
    sharded: bool = False       # trace.sharded (resolved): the train ranks write the routing rows (ray executor)


class StepShards(Protocol):
    """Writes a step as shards held by other processes plus its index (`trace.sharded`; the Ray
    executor's `RankShards`)."""

    def claim(self, step: int) -> None:
        """The rows the train side holds from `step`'s training are that step's."""

    def strip(self, record: StepRecord) -> StepRecord:
        """`record` without the rows the train side holds (what the learner queues and rings)."""

    def write(self, record: StepRecord) -> object:
        """Have the shards of `record.step` written, then its index (`record` without them)."""


class Learner:
    """The in-process learner: train worker + recording (`StepLearner`)."""

    def __init__(self, trainer: StepTrainer, run: RunDir, record: RecordSettings,
                 shards: StepShards | None = None) -> None:
        self.trainer, self.run, self.record, self.shards = trainer, run, record, shards
        self.trigger = SpikeTrigger.for_run(record.spike, run.path)  # trace.spike_ratio (off by default)
        self.tiers = TieredRecords(record.tiers)
        write = shards.write if shards is not None else functools.partial(_write, run, record.routing_encoding)
        self.writer = StepWriter(write, record.write_queue) if record.trace else None

    def step(self, batch: Batch, step: int, timer: PhaseTimer) -> dict[str, Any]:
        """Train on `batch` at weight version `step` (posting version `step + 1`) and write its trace record."""
        backend = self.trainer.backend
        self.trigger.before_step(backend)
        outcome = self.trainer.step(batch, step, timer)
        if self.shards is not None:
            self.shards.claim(step)
        metrics = step_metrics(outcome)
        metrics.update(self.trigger.after_step(backend, self.trainer.settings, outcome))  # the deep dump, now
        if self.writer is not None:
            timer.show("record")
            t0 = time.perf_counter()
            full = step_record(outcome, rng_digest(), routing=self.record.routing)
            if self.shards is not None:   # the ranks hold its routing: the queue and the ring need none
                full = self.shards.strip(full)
            waited = 0.0
            for rec in self.tiers.for_step(full, spiked=bool(metrics.get("spike"))):
                waited += self.writer.submit(rec)
            # The step's own cost of recording (building the record, waiting for room in the
            # queue); the write itself runs in the background (its latest duration beside it).
            metrics["time_record"] = time.perf_counter() - t0
            metrics["time_record_wait"] = waited
            metrics["time_record_write"] = self.writer.last_write_s
        return metrics

    def flush(self) -> None:
        """Return once every step file submitted so far is on disk."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Write the step files still queued; stop the writer thread."""
        if self.writer is not None:
            self.writer.close()

    def written_through(self) -> float:
        """The latest step whose trace file is on disk (-1: none yet; inf: the trace is off)."""
        return math.inf if self.writer is None else self.writer.written_through


def _write(run: RunDir, routing_encoding: str, record: StepRecord) -> None:
    """Write one step file; a step promoted by the spike ring replaces its reduced file."""
    run.write_step(record, routing_encoding=routing_encoding, overwrite=ATTR_PROMOTED_BY in record.attrs)
