"""TrainWorker: the trainer side of a step — a sealed batch in, new weights out.

prepare: advantages and packing (the AlgorithmProcessor), then the trainer's recompute of every
token's logprob before the update (`old_logprob`, the proximal policy of decoupled PPO) and,
with `trace.behaviour_logprob`, its logprob under the weights that *generated* it
(`behaviour_train_logprob`, from the copies of the last η versions the backend keeps), so that
old − rollout splits into an engine part and a staleness part.
train: the optimizer updates, through the code replay re-executes (`runtime/updates.py`).
sync: post the new weights; the rollout worker loads them when its schedule says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from axrl.algo.processor import AlgorithmProcessor, ProcessedBatch
from axrl.config import Config
from axrl.rollout.pool import Batch
from axrl.runtime.faults import lr_scale, perturb_batch
from axrl.runtime.progress import PhaseTimer
from axrl.runtime.records import TrainedStep
from axrl.runtime.reference import with_reference_logprobs
from axrl.runtime.updates import policy_loss, routing_replay, run_updates
from axrl.sync import WeightSync
from axrl.train.protocol import ForwardResult, TrainBackend


def version_key(version: int) -> str:
    """The `keep_weights` key of weight version `version`."""
    return f"v{version}"


class TrainWorker:
    def __init__(self, backend: TrainBackend, processor: AlgorithmProcessor, cfg: Config, sync: WeightSync,
                 num_experts: int) -> None:
        self.backend, self.processor, self.cfg, self.sync, self.num_experts = backend, processor, cfg, sync, num_experts
        # Behaviour logprobs of tokens up to η versions old need those versions' weights.
        self.keep_versions = (cfg.rollout.max_staleness if cfg.trace.behaviour_logprob and cfg.runtime.mode == "async"
                              else 0)

    def step(self, batch: Batch, step: int, timer: PhaseTimer) -> TrainedStep:
        """Train on `batch` at weight version `step` and post version `step + 1`."""
        cfg, backend = self.cfg, self.backend
        with timer("prepare"):
            processed = self.processor(batch.trajectories)
            processed.batch = perturb_batch(cfg, step, processed.batch)  # faults.rollout_logprob_noise; no-op by default
            old = backend.forward(processed.batch, r3=routing_replay(cfg))
            processed.batch = dataclasses.replace(processed.batch, old_logprobs=old.logprobs)
            processed.batch = with_reference_logprobs(backend, processed.batch, cfg)  # algo.kl_coef > 0
            behaviour = self.behaviour_logprobs(processed, old, step) if cfg.trace.behaviour_logprob else None
        if self.keep_versions:
            backend.keep_weights(version_key(step))
        fingerprint_before = backend.fingerprint()
        with timer("train"):
            # Shared with replay/, which re-runs these updates from the trace (axrl/runtime/updates.py).
            updates = run_updates(backend, processed.batch, processed.update_splits(cfg.train.updates_per_step),
                                  policy_loss(cfg), r3=routing_replay(cfg), lr_scale=lr_scale(cfg, step))
        with timer("sync"):
            self.sync.post(step + 1, backend.sync_source())
            if self.keep_versions:
                backend.forget_weights(version_key(step + 1 - self.keep_versions - 1))
        return TrainedStep(step=step, policy_version=step, batch=batch, processed=processed, old=old,
                           updates=updates, fingerprint_before=fingerprint_before,
                           fingerprint_after=updates[-1].fingerprint, behaviour=behaviour,
                           wall_times=timer.times, num_experts=self.num_experts)

    def behaviour_logprobs(self, processed: ProcessedBatch, old: ForwardResult, step: int) -> torch.Tensor:
        """float32 [T]: each generated token's trainer logprob under the weights of the version that
        generated it (NaN elsewhere). Tokens of the current version take `old` as it is — same
        weights, same forward — so their staleness part is exactly 0."""
        batch = processed.batch
        versions = torch.from_numpy(np.concatenate([t.policy_version for t in processed.trajectories]).astype(np.int64))
        out = torch.where(versions >= 0, old.logprobs, torch.full_like(old.logprobs, float("nan")))
        sample_of = batch.sample_index()
        for v in sorted(set(versions[(versions >= 0) & (versions != step)].tolist())):
            rows = sorted(set(sample_of[versions == v].tolist()))
            sub = batch.select(rows)
            res = self.backend.forward(sub, r3=routing_replay(self.cfg), weights=version_key(v))
            idx = torch.cat([torch.arange(int(batch.offsets[r]), int(batch.offsets[r + 1])) for r in rows])
            pick = versions[idx] == v
            out[idx[pick]] = res.logprobs[pick]
        return out
