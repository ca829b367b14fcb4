"""Faults and recoveries of a run, as events: one JSON object per line in RUN/events.jsonl.

Components record events from the moment they are built; the log holds them in memory until
the run directory exists (`attach`), then appends every event as it happens (flushed, so a
crashed run keeps its story).
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


class EventLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._path: Path | None = None

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        entry = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(), "event": event, **fields}
        with self._lock:
            self._events.append(entry)
            if self._path is not None:
                self._append([entry])
        return entry

    def attach(self, run_path: Path) -> None:
        """Write the events so far to `run_path/events.jsonl` and every later one as it happens."""
        with self._lock:
            self._path = Path(run_path) / EVENTS_FILE
            if self._events:
                self._append(self._events)

    def _append(self, entries: list[dict[str, Any]]) -> None:
        assert self._path is not None
        with open(self._path, "a", encoding="utf-8") as fh:
            for e in entries:
                fh.write(json.dumps(e, default=str) + "\n")
            fh.flush()

    @property
    def run_path(self) -> Path | None:
        """The run directory once attached."""
        with self._lock:
            return None if self._path is None else self._path.parent

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)


def read_events(run_path: Path) -> list[dict[str, Any]]:
    """The events of a run directory (none when it has no events file)."""
    path = Path(run_path) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
