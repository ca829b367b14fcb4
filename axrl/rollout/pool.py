"""TrajectoryPool: gathers samples by group and releases only complete groups to the trainer."""

from __future__ import annotations

from collections import OrderedDict

from axrl.rollout.trajectory import Trajectory


class TrajectoryPool:
    """Groups of `group_size` samples per prompt, released whole and in arrival order of groups.

    Within a group, samples are ordered by sample_id so the packed batch — and everything the
    trace and replay derive from it — does not depend on which sample finished first.
    """

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._groups: OrderedDict[int, list[Trajectory]] = OrderedDict()

    def add(self, trajectory: Trajectory) -> None:
        group = self._groups.setdefault(trajectory.group_id, [])
        if len(group) >= self.group_size:
            raise ValueError(f"group {trajectory.group_id} already has {self.group_size} samples")
        group.append(trajectory)

    def num_complete(self) -> int:
        return sum(len(g) == self.group_size for g in self._groups.values())

    def pop_complete(self, max_groups: int | None = None) -> list[Trajectory]:
        """Remove and return the samples of up to `max_groups` complete groups."""
        out: list[Trajectory] = []
        taken = 0
        for gid in [g for g, s in self._groups.items() if len(s) == self.group_size]:
            if max_groups is not None and taken >= max_groups:
                break
            out.extend(sorted(self._groups.pop(gid), key=lambda t: t.sample_id))
            taken += 1
        return out

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())
