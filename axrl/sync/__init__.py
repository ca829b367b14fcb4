"""Weight synchronisation between the trainer and the rollout engines."""

from axrl.sync.controller import WeightSync

__all__ = ["WeightSync"]
