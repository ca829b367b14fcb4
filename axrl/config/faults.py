"""The `faults` config section (axrl/config/schema.py): deliberate faults that create real spikes."""

from __future__ import annotations

from pydantic import Field

from axrl.core.settings import Section


class LrScaleFault(Section):
    """Multiply the learning rate of every update of one step (a learning-rate jump)."""

    step: int = Field(..., ge=0)
    factor: float = Field(..., gt=0)


class RolloutLogprobNoiseFault(Section):
    """Add Gaussian noise to the rollout logprobs of the generated tokens of one step (an inference
    engine that disagrees with the trainer, e.g. stale weights or a bad kernel)."""

    step: int = Field(..., ge=0)
    std: float = Field(..., gt=0)


class FaultsSection(Section):
    """Deliberate faults, off by default: they create real spikes to demonstrate and test the
    debugging tools (`axrl-debug replay`). They live in config.yaml, so a replay honours them."""

    lr_scale: LrScaleFault | None = None
    rollout_logprob_noise: RolloutLogprobNoiseFault | None = None
