"""The run's health table: every actor's heartbeat, polled by the driver, written to RUN/status.json.

Each row: component, state (idle / busy / dead), pid, last heartbeat, current work and since
when, calls, errors and the last one, throughput counters. An actor that does not answer within
the poll's timeout is shown as unreachable with the error; `axrl status RUN` prints the table
with the run's events (faults, restarts).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from axrl.runtime.recording.events import EventLog
from axrl.trace.run_dir import atomic_write_text

STATUS_FILE = "status.json"


class Monitor:
    def __init__(self, sources: dict[str, Callable[[], Any]], events: EventLog, interval_s: float) -> None:
        self.sources, self.events, self.interval_s = sources, events, interval_s
        self._stop = threading.Event()
        self._last: list[dict[str, Any]] = []
        self._last_time = 0.0
        self._thread = threading.Thread(target=self._run, name="axrl-ray-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def add(self, name: str, poll: Callable[[], Any]) -> None:
        """Poll one more source from now on (an actor started after the monitor)."""
        self.sources = {**self.sources, name: poll}

    def rows(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name, poll in self.sources.items():
            try:
                report = poll()
            except Exception as e:  # noqa: BLE001 — an unreachable actor is a row, not a crash
                out.append({"component": name, "state": "unreachable", "heartbeat": None,
                            "last_error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            out.extend(report if isinstance(report, list) else [report])
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._last, self._last_time = self.rows(), time.time()
            self._write(self._last)

    def latest(self) -> tuple[float, list[dict[str, Any]]]:
        """(time, rows) of the latest poll; no rows before the first."""
        return self._last_time, self._last

    def _write(self, rows: list[dict[str, Any]]) -> None:
        path = self.events.run_path
        if path is not None:
            status = {"time": time.time(), "actors": rows}
            atomic_write_text(Path(path) / STATUS_FILE, json.dumps(status, default=str, indent=1) + "\n")

    def stop(self) -> None:
        """Stop polling; the table's last rows say the actors stopped with the run."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        # The last heartbeats (the actors may already be gone: the run closes them first).
        self._write([{**r, "state": "stopped", "work": None} for r in self._last])


def read_status(run_path: Path) -> dict[str, Any] | None:
    path = Path(run_path) / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
