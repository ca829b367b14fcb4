"""Black-box agent sessions in a trace: per step, how many sessions, their forks and drift.

Reads `/samples/{session_id, fork_of, fork_cause, drift_tokens}` (written only for runs with an `agent`
section); steps without them are left out, so a white-box run has no rows.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from axrl.trace import TraceReader

COLUMNS = ("/samples/session_id", "/samples/fork_of", "/samples/fork_cause", "/samples/drift_tokens",
           "/samples/sample_id", "/samples/status")


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def sessions_by_step(reader: TraceReader, steps: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """One row per step that has session columns: sessions, samples, fork paths, samples with
    drift, drift tokens, failed sessions, the sample ids of the forks and drifted samples, and the
    fork paths per cause (traces written before fork causes count theirs under "")."""
    rows = []
    for sc in reader.iter_columns([], steps, optional=COLUMNS):
        if "/samples/session_id" not in sc:
            continue
        sid = [_str(s) for s in sc["/samples/session_id"]]
        fork_of = np.asarray(sc["/samples/fork_of"])
        drift = np.asarray(sc["/samples/drift_tokens"])
        ids = np.asarray(sc["/samples/sample_id"])
        status = [_str(s) for s in sc["/samples/status"]]
        failed = {s for s, st in zip(sid, status) if s and st != "ok"}
        causes = [_str(c) for c in sc["/samples/fork_cause"]] if "/samples/fork_cause" in sc else [""] * len(sid)
        by_cause: dict[str, int] = {}
        for cause, parent in zip(causes, fork_of):
            if parent >= 0:
                by_cause[cause] = by_cause.get(cause, 0) + 1
        rows.append({"step": sc.step, "sessions": len({s for s in sid if s}), "samples": len(sid),
                     "forks": int((fork_of >= 0).sum()), "drift_samples": int((drift > 0).sum()),
                     "drift_tokens": int(drift.sum()), "failed_sessions": len(failed),
                     "fork_ids": ids[fork_of >= 0].tolist(), "drift_ids": ids[drift > 0].tolist(),
                     "fork_causes": by_cause})
    return rows
