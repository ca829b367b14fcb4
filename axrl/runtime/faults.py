"""Deliberate faults (config section `faults`, off by default).

They exist to create *real* spikes — recorded by the normal trace, reproducible by replay — so
the debugging tools can be demonstrated and tested on something other than synthetic data.
Each fault acts at one step and goes through the same code path in training and in replay:

* `lr_scale {step, factor}` — every optimizer update of `step` runs with `factor` × the
  scheduled learning rate (the trace's `/train/updates/lr` shows the scaled value).
  Applied by `run_updates` (as `optimizer_step(lr_scale=...)`), which replay calls too, so a
  replay reproduces the jump.
* `rollout_logprob_noise {step, std}` — Gaussian noise (seeded by run seed and step) is added to
  the rollout logprobs of the generated tokens of `step`, before the loss sees them. The trace
  records the noisy values, which is what the loss used, so replay needs nothing extra.
"""

from __future__ import annotations

import dataclasses

import torch
from pydantic import Field

from axrl.core.settings import Section
from axrl.train.protocol import PackedBatch


class LrScaleFault(Section):
    """Multiply the learning rate of every update of one step (a learning-rate jump)."""

    step: int = Field(..., ge=0)
    factor: float = Field(..., gt=0)


class RolloutLogprobNoiseFault(Section):
    """Add Gaussian noise to the rollout logprobs of the generated tokens of one step (an inference
    engine that disagrees with the trainer, e.g. stale weights or a bad kernel)."""

    step: int = Field(..., ge=0)
    std: float = Field(..., gt=0)


class Faults(Section):
    """The YAML section `faults`: the run's deliberate faults, off by default, at most one of each
    kind, each at one step. They live in config.yaml, so a replay honours them."""

    lr_scale: LrScaleFault | None = None
    rollout_logprob_noise: RolloutLogprobNoiseFault | None = None

    def lr_scale_at(self, step: int) -> float:
        """The learning-rate factor of `step` (1.0 unless `faults.lr_scale` targets it)."""
        f = self.lr_scale
        return f.factor if f is not None and f.step == step else 1.0

    def perturb(self, step: int, batch: PackedBatch, seed: int) -> PackedBatch:
        """The batch with `faults.rollout_logprob_noise` applied when it targets `step` (else
        unchanged); the noise of a step is a function of (the run's `seed`, step)."""
        f = self.rollout_logprob_noise
        if f is None or f.step != step or batch.rollout_logprobs is None:
            return batch
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        noise = torch.randn(batch.rollout_logprobs.shape, generator=gen, dtype=torch.float32) * f.std
        # NaN (prompt / env tokens) stays NaN: only what the engine generated is "corrupted".
        return dataclasses.replace(batch, rollout_logprobs=batch.rollout_logprobs + noise)
