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
from dataclasses import dataclass

import torch

from axrl.train.protocol import PackedBatch


@dataclass(frozen=True)
class Faults:
    """The run's deliberate faults (config section `faults`): at most one of each kind, each at
    one step. `seed` is the run's: the noise of a step is a function of (seed, step)."""

    seed: int = 0
    lr_scale: tuple[int, float] | None = None           # (step, factor)
    rollout_logprob_noise: tuple[int, float] | None = None   # (step, std)

    def lr_scale_at(self, step: int) -> float:
        """The learning-rate factor of `step` (1.0 unless `faults.lr_scale` targets it)."""
        f = self.lr_scale
        return f[1] if f is not None and f[0] == step else 1.0

    def perturb(self, step: int, batch: PackedBatch) -> PackedBatch:
        """The batch with `faults.rollout_logprob_noise` applied when it targets `step` (else unchanged)."""
        f = self.rollout_logprob_noise
        if f is None or f[0] != step or batch.rollout_logprobs is None:
            return batch
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        noise = torch.randn(batch.rollout_logprobs.shape, generator=gen, dtype=torch.float32) * f[1]
        # NaN (prompt / env tokens) stays NaN: only what the engine generated is "corrupted".
        return dataclasses.replace(batch, rollout_logprobs=batch.rollout_logprobs + noise)
