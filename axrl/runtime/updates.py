"""The training part of a step — the optimizer updates.

Shared by the loop (`run_step`) and by deterministic re-execution (`replay/`): a replayed step
runs exactly this code on the batch rebuilt from the trace, so bitwise agreement with the
recording tests the recording, not a re-implementation of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol, Sequence

import numpy as np
import torch

from axrl.algo.processor import update_splits
from axrl.runtime.results import CriticStep, UpdateResult
from axrl.train.critic import Critic, critic_batch
from axrl.train.protocol import R3, LossFn, PackedBatch, TrainBackend


class UpdateHooks(Protocol):
    """Observation points inside `run_updates` (replay's instrumentation; training passes none).
    Hooks must only read: anything they change would break bitwise re-execution."""

    def before_update(self, index: int, batch: PackedBatch) -> None:
        """Called with the update's batch before its forward_backward."""

    def before_optimizer_step(self, index: int) -> None:
        """Called after forward_backward, while the accumulated gradients are still there."""

    def after_update(self, index: int, result: UpdateResult) -> None:
        """Called after the update's optimizer step, with what it did."""


class CombinedHooks:
    """Several `UpdateHooks` called in order."""

    def __init__(self, *hooks: UpdateHooks | None) -> None:
        self.hooks = [h for h in hooks if h is not None]

    def before_update(self, index: int, batch: PackedBatch) -> None:
        for h in self.hooks:
            h.before_update(index, batch)

    def before_optimizer_step(self, index: int) -> None:
        for h in self.hooks:
            h.before_optimizer_step(index)

    def after_update(self, index: int, result: UpdateResult) -> None:
        for h in self.hooks:
            h.after_update(index, result)


def run_updates(backend: TrainBackend, batch: PackedBatch, splits: Sequence[Sequence[int]], loss_fn: LossFn, *,
                r3: R3, lr_scale: float = 1.0, hooks: UpdateHooks | None = None) -> list[UpdateResult]:
    """One optimizer update per entry of `splits` (sample rows of `batch`, in order).

    `batch` must carry the old logprobs. Each update is forward_backward over its samples, then
    optimizer_step, then a weights fingerprint — the order the trace records.

    `lr_scale == 0` (the critic's warm-up, `critic.warmup_steps`) is no update at all: the updates
    still run, so the step's losses, token columns and grad norms are recorded as in any step, but
    the backend's state is restored afterwards — an AdamW step at rate 0 would leave the weights
    but move the moments, the step counts and the schedule position, so the policy's first real
    update would not be the one a run without the warm-up makes (`frozen_policy`).
    """
    if lr_scale == 0.0:
        with frozen_policy(backend):
            return _updates(backend, batch, splits, loss_fn, r3=r3, lr_scale=lr_scale, hooks=hooks)
    return _updates(backend, batch, splits, loss_fn, r3=r3, lr_scale=lr_scale, hooks=hooks)


@contextmanager
def frozen_policy(backend: TrainBackend) -> Iterator[None]:
    """Run the body, then put the backend back as it was: weights, AdamW moments and step counts,
    schedule counters and RNG (its `state_dict`, a copy). Costs a copy of the weights and moments,
    paid only in the steps that train nothing."""
    saved = backend.state_dict()
    try:
        yield
    finally:
        backend.load_state_dict(saved)


def _updates(backend: TrainBackend, batch: PackedBatch, splits: Sequence[Sequence[int]], loss_fn: LossFn, *,
             r3: R3, lr_scale: float, hooks: UpdateHooks | None) -> list[UpdateResult]:
    results = []
    for u, samples in enumerate(splits):
        samples = list(samples)
        sub = batch.select(samples)
        if hooks is not None:
            hooks.before_update(u, sub)
        metrics = backend.forward_backward(sub, loss_fn, r3=r3)
        if hooks is not None:
            hooks.before_optimizer_step(u)
        stats = backend.optimizer_step(lr_scale=lr_scale)
        results.append(UpdateResult(samples, metrics, stats, backend.fingerprint()))
        if hooks is not None:
            hooks.after_update(u, results[-1])
    return results


def train_critic(critic: Critic, batch: PackedBatch, group_ids: Sequence[int] | np.ndarray, values: torch.Tensor,
                 returns: torch.Tensor) -> CriticStep:
    """The critic's updates of a step (after the policy's): `critic.updates_per_step` mini-batches of
    whole groups (`update_splits`, as the policy's), regressing on GAE's `returns` from the old
    `values` (value clipping around them). Replay calls this on the batch rebuilt from the trace."""
    before = critic.fingerprint()
    splits = update_splits(group_ids, critic.config.updates_per_step)
    updates = critic.train(critic_batch(batch, values, returns), splits)
    return CriticStep(updates=updates, fingerprint_before=before, fingerprint_after=critic.fingerprint())
