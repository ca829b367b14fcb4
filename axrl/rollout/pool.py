"""TrajectoryPool: the persistent hand-over between rollout and training.

Rollout puts finished samples in; a group (the `group_size` samples of one prompt) becomes
*complete* when its last sample arrives. The rollout worker *seals* batch w from the complete
groups — in completion order, each checked for freshness against step w — and the trainer
*takes* sealed batches, blocking until the one it wants exists. Groups live here across steps:
a long episode may start while step w trains and be trained at step w + 2.

Within a batch, groups are ordered by group id and samples by sample id, so the packed batch —
and everything the trace and replay derive from it — does not depend on which finished first.
Thread-safe: the worker (adds, seals) and the trainer (takes) run in different threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from axrl.core.trajectory import Trajectory


@dataclass
class Group:
    """The samples of one prompt, as they arrive."""

    group_id: int
    size: int
    samples: list[Trajectory] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        # Forks of a black-box session (fork_of >= 0) come with their episode's sample.
        return sum(t.fork_of < 0 for t in self.samples) == self.size

    @property
    def min_version(self) -> int | None:
        """Oldest weight version among the group's generated tokens (None: it generated none)."""
        versions = [int(t.policy_version[t.loss_mask > 0].min()) for t in self.samples if t.num_generated]
        return min(versions) if versions else None


@dataclass
class GroupFate:
    """A group that left the pool without being trained, recorded with the batch it was meant for."""

    group_id: int
    reason: str               # "stale" | "partial_drop" | "max_reruns"
    min_version: int          # −1 when unknown (it generated nothing yet)


@dataclass
class Batch:
    """What step `step` trains: whole groups, plus what happened to the groups that did not make it."""

    step: int
    trajectories: list[Trajectory]
    dropped: list[GroupFate] = field(default_factory=list)
    reruns: list[int] = field(default_factory=list)          # group ids re-started while filling it

    @property
    def group_ids(self) -> list[int]:
        return list(dict.fromkeys(t.group_id for t in self.trajectories))

    def version_lag(self) -> np.ndarray:
        """int [generated tokens]: step − generating version of every generated token."""
        parts = [self.step - t.policy_version[t.loss_mask > 0] for t in self.trajectories]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class PoolFailure(RuntimeError):
    """The rollout side died; the trainer gets this instead of waiting forever."""


class TrajectoryPool:
    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._open: OrderedDict[int, Group] = OrderedDict()   # incomplete groups
        self._complete: deque[Group] = deque()                # in completion order
        self._sealed: dict[int, Batch] = {}
        self._cv = threading.Condition()
        self._failure: BaseException | None = None

    # -- rollout side ------------------------------------------------------------------------------
    def add(self, trajectory: Trajectory) -> bool:
        """Add a finished sample (with the forks of its session, if any); True when it completed its group."""
        with self._cv:
            if any(g.group_id == trajectory.group_id for g in self._complete):
                raise ValueError(f"group {trajectory.group_id} already has {self.group_size} samples")
            group = self._open.setdefault(trajectory.group_id, Group(trajectory.group_id, self.group_size))
            group.samples.append(trajectory)
            group.samples.extend(trajectory.forks)
            if not group.complete:
                return False
            del self._open[trajectory.group_id]
            self._complete.append(group)
            return True

    def discard(self, group_id: int) -> None:
        """Forget a group's samples (complete or not): it will not be trained."""
        with self._cv:
            self._open.pop(group_id, None)
            self._complete = deque(g for g in self._complete if g.group_id != group_id)

    def seal(self, step: int, groups: int, fresh: Callable[[Group], bool]) -> tuple[Batch | None, list[Group]]:
        """Try to seal batch `step` from `groups` fresh complete groups.

        Returns (the batch or None, the stale groups found on the way — removed from the pool for
        the caller to drop or re-run). When there are not enough fresh groups yet, the fresh ones
        stay, in their order, for the next attempt.
        """
        with self._cv:
            if step in self._sealed:
                raise ValueError(f"batch {step} is already sealed")
            stale = [g for g in self._complete if not fresh(g)]
            keep = [g for g in self._complete if fresh(g)]
            if len(keep) < groups:
                self._complete = deque(keep)
                return None, stale
            chosen, rest = keep[:groups], keep[groups:]
            self._complete = deque(rest)
            trajectories = [t for g in sorted(chosen, key=lambda g: g.group_id)
                            for t in sorted(g.samples, key=lambda t: t.sample_id)]
            return Batch(step, trajectories), stale

    def publish(self, batch: Batch) -> None:
        """Make a sealed batch available to `take`."""
        with self._cv:
            self._sealed[batch.step] = batch
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer died: wake and fail every `take`."""
        with self._cv:
            self._failure = error
            self._cv.notify_all()

    # -- trainer side ------------------------------------------------------------------------------
    def take(self, step: int, timeout: float | None = None) -> Batch:
        """Block until batch `step` is sealed, then remove and return it."""
        with self._cv:
            if not self._cv.wait_for(lambda: step in self._sealed or self._failure is not None, timeout):
                raise TimeoutError(f"batch {step} was not sealed within {timeout} s")
            if step not in self._sealed:
                raise PoolFailure(f"rollout failed before batch {step} was sealed: "
                                  f"{type(self._failure).__name__}: {self._failure}") from self._failure
            return self._sealed.pop(step)

    # -- state -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._cv:
            return (sum(len(g.samples) for g in self._open.values())
                    + sum(len(g.samples) for g in self._complete))

    def num_complete(self) -> int:
        with self._cv:
            return len(self._complete)
