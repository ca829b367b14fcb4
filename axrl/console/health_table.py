"""The actors' health table (component, state, pid, heartbeat, work, calls, errors) as a rich
Table: printed by `axrl status RUN` from RUN/status.json, and shown live under the progress bar
of a `runtime.executor: ray` run from the monitor's latest heartbeats."""

from __future__ import annotations

from typing import Any

from rich.table import Table

COLUMNS = ("component", "state", "pid", "heartbeat", "work", "since", "calls", "errors", "last error")
# The columns that name an actor never wrap: a long error message must not squeeze "train rank 0"
# onto two lines (where neither a reader nor grep finds it).
WHOLE = ("component", "pid")


def health_table(rows: list[dict[str, Any]], now: float, title: str | None = None) -> Table:
    """One row per actor heartbeat in `rows` (the monitor's format); ages relative to `now`."""
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, no_wrap=col in WHOLE)
    for a in rows:
        beat = a.get("heartbeat")
        table.add_row(str(a.get("component")), str(a.get("state")), str(a.get("pid", "")),
                      "—" if beat is None else f"{max(0.0, now - beat):.1f} s before",
                      str(a.get("work") or ""), f"{a.get('since_s', 0):.1f} s" if a.get("work") else "",
                      str(a.get("calls", "")), str(a.get("errors", "")), str(a.get("last_error") or ""))
    return table
