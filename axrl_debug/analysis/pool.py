"""What the rollout pool left out of each step: groups dropped (too stale, running at a weight
update, not selected by dynamic sampling), groups re-run, and the recorded samples of dropped
groups (`/pool/samples`, never trained).

Reads `/pool/*` (written only for steps where something was dropped or re-run); steps without
any are left out, so a synchronous run without dynamic sampling has no rows.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import numpy as np

from axrl.trace import TraceReader

COLUMNS = ("/pool/dropped_group_id", "/pool/dropped_reason", "/pool/rerun_group_id", "/pool/samples/sample_id",
           "/pool/samples/reward", "/pool/tokens/ids")


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def pool_by_step(reader: TraceReader, steps: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """One row per step with pool records: dropped groups by reason, re-run groups, and the
    dropped samples recorded (their count, tokens and mean reward)."""
    rows = []
    for sc in reader.iter_columns([], steps, optional=COLUMNS):
        if not any(name in sc for name in COLUMNS):
            continue
        reasons = Counter(_str(r) for r in sc.get("/pool/dropped_reason", []))
        rewards = np.asarray(sc.get("/pool/samples/reward", np.zeros(0)), dtype=np.float64)
        rows.append({"step": sc.step, "dropped_groups": len(sc.get("/pool/dropped_group_id", [])),
                     "dropped_by_reason": dict(sorted(reasons.items())),
                     "rerun_groups": len(sc.get("/pool/rerun_group_id", [])),
                     "dropped_samples": int(rewards.size),
                     "dropped_tokens": len(sc.get("/pool/tokens/ids", [])),
                     "dropped_reward_mean": float(rewards.mean()) if rewards.size else None})
    return rows
