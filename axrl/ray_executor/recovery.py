"""The train group's recovery policy: a dead train rank restarts the run from its last checkpoint.

The train group's state (weights, optimizer moments) lives only in its ranks, so a lost rank
means a lost group: the run is closed (every actor stopped) and resumed with `--resume`'s own
machinery — steps recorded after the checkpoint are redone once, the rollout groups pending at
the checkpoint restart under their identities — at most `runtime.ray.train_restarts` times,
each recorded as an event. Then the run stops with a message naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from axrl.runtime.recording.events import EventLog
from axrl.ray_executor.train_group import TrainGroupLost


class TrainGroupFailed(RuntimeError):
    """The train group died more often than `runtime.ray.train_restarts` allows."""


def train_with_recovery(run_dir: str | Path, resume: bool, train: Callable[[bool], Path], *,
                        max_restarts: int) -> Path:
    """`train(resume)`, resumed from the last checkpoint after a train-group loss, at most
    `max_restarts` (`runtime.ray.train_restarts`) times."""
    restarts = 0
    while True:
        try:
            return train(resume)
        except TrainGroupLost as e:
            log = EventLog()
            log.attach(Path(run_dir))
            if restarts >= max_restarts:
                log.record("run_stopped", component="train group", reason=str(e), restarts=restarts)
                raise TrainGroupFailed(f"the train group died again after {restarts} restart(s) "
                                       f"(runtime.ray.train_restarts={max_restarts}): {e}") from e
            restarts += 1
            log.record("train_group_restart", component="train group", restart=restarts,
                       reason=str(e.__cause__ or e)[:300], action="resume from the last checkpoint")
            resume = True
