"""StepTrainer: the trainer side of a step — a sealed batch in, new weights out.

prepare: advantages and packing (the AlgorithmProcessor), then the trainer's recompute of every
token's logprob before the update (`old_logprob`, the proximal policy of decoupled PPO) and,
with `trace.behaviour_logprob`, its logprob under the weights that *generated* it
(`behaviour_train_logprob`, from the copies of the last η versions the backend keeps), so that
old − rollout splits into an engine part and a staleness part; with `distill`, the teacher's
logprobs and the distillation advantage (axrl/algo/distill.py); with a critic (PPO,
`algo.advantage: gae`), the critic's values of the batch and GAE's advantages and returns.
train: the optimizer updates, through the code replay re-executes (`runtime/updates.py`), then
the critic's updates on the returns (`train_critic`).
sync: post the new weights; the rollout worker loads them when its schedule says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from axrl.algo import PolicyLoss, make_policy_loss
from axrl.algo.loss_config import PolicyLossConfig
from axrl.algo.distill import DistillSettings, with_distillation
from axrl.algo.processor import AlgorithmProcessor, ProcessedBatch, with_gae
from axrl.rollout.pool import Batch
from axrl.runtime.faults import Faults
from axrl.console.progress import PhaseTimer
from axrl.runtime.results import TrainedStep
from axrl.runtime.reference import with_reference_logprobs
from axrl.runtime.updates import run_updates, train_critic
from axrl.sync import WeightSync
from axrl.train.critic import Critic
from axrl.train.protocol import R3, ForwardResult, TrainBackend

if TYPE_CHECKING:
    from axrl.runtime.teacher import Teacher


@dataclass(frozen=True)
class TrainStepSettings:
    """What the trainer does with each sealed batch.

    loss: the policy loss's knobs; r3: routing replay (`R3`, from `r3` / `r3_scope`);
    updates_per_step: optimizer updates (mini-batches) per step; behaviour_logprob: also compute
    each token's logprob under the weights that generated it; keep_versions: how many past
    versions' weights that needs (the staleness bound η of an async run, else 0); faults: the
    run's deliberate faults (off by default).
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    r3: R3 = False
    updates_per_step: int = 1
    behaviour_logprob: bool = False
    keep_versions: int = 0
    faults: Faults = field(default_factory=Faults)
    seed: int = 0                    # the run's: seeds faults.rollout_logprob_noise
    critic_warmup_steps: int = 0     # first steps in which only the critic learns (policy frozen)

    def lr_scale_at(self, step: int) -> float:
        """The policy's learning-rate factor at `step`: the faults' (1 by default), times 0 while
        the critic warms up. At 0 `run_updates` runs and records the policy's updates, then restores
        the backend's state: weights, AdamW moments, step counts and schedule are as before the step
        (replay applies the same factor, so it re-executes the same way)."""
        return self.faults.lr_scale_at(step) * (0.0 if step < self.critic_warmup_steps else 1.0)

    @property
    def needs_reference(self) -> bool:
        """A KL penalty needs the frozen reference policy's logprobs."""
        return self.loss.kl_coef > 0

    @cached_property
    def loss_fn(self) -> PolicyLoss:
        """The step's `LossFn`, built once per run (a frozen settings object: it cannot change)."""
        return make_policy_loss(self.loss)


def version_key(version: int) -> str:
    """The `keep_weights` key of weight version `version`."""
    return f"v{version}"


class StepTrainer:
    def __init__(self, backend: TrainBackend, processor: AlgorithmProcessor, settings: TrainStepSettings,
                 sync: WeightSync, num_experts: int, *, distill: DistillSettings | None = None,
                 teacher: Teacher | None = None, critic: Critic | None = None) -> None:
        self.backend, self.processor, self.settings, self.sync = backend, processor, settings, sync
        self.critic = critic   # PPO's value model (algo.advantage: gae; axrl/train/critic.py)
        if processor.settings.estimator == "gae" and critic is None:
            raise ValueError("algo.advantage: gae needs the critic's values, but this train backend holds no critic "
                             "(a `critic` section builds one in the torch or Megatron backend)")
        # On-policy distillation (algo/distill.py): `teacher` scores each batch (runtime/teacher.py).
        self.distill, self.teacher = distill, teacher
        self.num_experts = num_experts
        # Behaviour logprobs of tokens up to η versions old need those versions' weights.
        self.keep_versions = settings.keep_versions

    def step(self, batch: Batch, step: int, timer: PhaseTimer) -> TrainedStep:
        """Train on `batch` at weight version `step` and post version `step + 1`."""
        s, backend = self.settings, self.backend
        with timer("prepare"):
            processed = self.processor(batch.trajectories)
            processed.batch = s.faults.perturb(step, processed.batch, s.seed)  # faults.rollout_logprob_noise; no-op by default
            if self.critic is not None:  # the old values, before this step's critic updates
                processed = with_gae(processed, self.critic.values(processed.batch), self.processor.settings)
            old = backend.forward(processed.batch, r3=s.r3)
            processed.batch = dataclasses.replace(processed.batch, old_logprobs=old.logprobs)
            processed.batch = with_reference_logprobs(backend, processed.batch, s.needs_reference, s.r3)
            if self.teacher is not None:
                assert self.distill is not None
                processed = with_distillation(processed, self.teacher.score(processed.batch), self.distill)
            behaviour = self.behaviour_logprobs(processed, old, step) if s.behaviour_logprob else None
        if self.keep_versions:
            backend.keep_weights(version_key(step))
        fingerprint_before = backend.fingerprint()
        with timer("train"):
            # Shared with replay/, which re-runs these updates from the trace (axrl/runtime/updates.py).
            updates = run_updates(backend, processed.batch, processed.update_splits(s.updates_per_step),
                                  s.loss_fn, r3=s.r3, lr_scale=s.lr_scale_at(step))
            critic = None
            if self.critic is not None:
                assert processed.values is not None and processed.returns is not None
                critic = train_critic(self.critic, processed.batch, [t.group_id for t in processed.trajectories],
                                      processed.values, processed.returns)
        with timer("sync"):
            self.sync.post(step + 1, backend.sync_source())
            if self.keep_versions:
                backend.forget_weights(version_key(step + 1 - self.keep_versions - 1))
        return TrainedStep(step=step, policy_version=step, batch=batch, processed=processed, old=old,
                           updates=updates, fingerprint_before=fingerprint_before,
                           fingerprint_after=updates[-1].fingerprint, behaviour=behaviour,
                           wall_times=timer.times, num_experts=self.num_experts, critic=critic)

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
            res = self.backend.forward(sub, r3=self.settings.r3, weights=version_key(v))
            idx = torch.cat([torch.arange(int(batch.offsets[r]), int(batch.offsets[r + 1])) for r in rows])
            pick = versions[idx] == v
            out[idx[pick]] = res.logprobs[pick]
        return out
