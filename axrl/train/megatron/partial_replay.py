"""Partial R3 on megatron-core's routers: replay the recorded experts on some token rows of a
layer and let the router choose on the others (`R3Scope.loss_tokens_only`), recording the
routing actually used.

megatron-core's `RouterReplay` replays a whole layer or nothing; its `get_replay_topk` is the one
place a router asks for its top-k, so a per-instance replacement of that method (this router
only, removed after the forward) is the narrowest hook.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["replay_rows", "stop_partial"]

_ATTR = "get_replay_topk"


def replay_rows(router: Any, target: torch.Tensor, rows: torch.Tensor) -> None:
    """Make `router` (a RouterReplay) use `target` [n, k] where `rows` [n] is True and its own
    top-k elsewhere, for its next forwards, recording the merged indices."""

    def get_replay_topk(scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        used = torch.where(rows.to(scores.device)[:, None], target.to(scores.device), own)
        router.record_indices(used)
        return scores.gather(1, used), used

    setattr(router, _ATTR, get_replay_topk)


def stop_partial(router: Any) -> None:
    """Back to the class's own replay behaviour."""
    router.__dict__.pop(_ATTR, None)
