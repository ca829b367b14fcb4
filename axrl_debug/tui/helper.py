"""The TUI's helper process: spike detection and the step-file scan, off the UI process.

Reading 1,000 step files and building pandas frames holds the GIL for seconds; in a thread of the
UI process that made every key press wait. The app starts ``python -m axrl_debug.tui.helper``
and talks JSON lines over its stdin/stdout (one request, one reply), rather than using
``multiprocessing``, whose spawn start method re-imports the caller's ``__main__`` (a user's
unguarded script would start a second TUI).

Requests: ``{"op": "spikes", "steps": [...], "series": {...}, "dtype": "float32"}`` → ``{"spikes": {step: [...]}}``;
``{"op": "scan", "path": RUN, "steps": [...]}`` → ``{"rows": {step: {...}}}``. Errors come back as
``{"error": "..."}``; end of stdin ends the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from .data import detect_spikes, scan_steps


def handle(request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "spikes":
        spikes = detect_spikes([int(s) for s in request["steps"]], request["series"], request.get("dtype", "float32"))
        return {"spikes": {str(k): v for k, v in spikes.items()}}
    if op == "scan":
        rows = scan_steps(str(request["path"]), [int(s) for s in request["steps"]])
        return {"rows": {str(k): v for k, v in rows.items()}}
    return {"error": f"unknown op {op!r}"}


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    for line in stdin:
        if not line.strip():
            continue
        try:
            reply = handle(json.loads(line))
        except Exception as e:  # report, keep serving: one bad step must not end the scan
            reply = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply, default=_plain) + "\n")
        stdout.flush()


def _plain(o: Any) -> Any:
    """numpy scalars → Python (json's default hook)."""
    return o.item() if hasattr(o, "item") else str(o)


class Helper:
    """Parent side: one helper process, one request at a time (the app's background thread)."""

    def __init__(self) -> None:
        # The child must import this very axrl_debug (a source checkout may not be installed).
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "axrl_debug.tui.helper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     bufsize=1, env=env)

    def request(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("helper process ended")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def spikes(self, steps: list[int], series: dict[str, list[float]],
               dtype: str = "float32") -> dict[int, list[dict[str, Any]]]:
        return {int(k): v for k, v in self.request(op="spikes", steps=steps, series=series,
                                                   dtype=dtype)["spikes"].items()}

    def scan(self, path: str, steps: list[int]) -> dict[int, dict[str, float]]:
        return {int(k): v for k, v in self.request(op="scan", path=path, steps=steps)["rows"].items()}

    def close(self) -> None:
        """Stop the helper now (quit must not wait for a scan chunk)."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


if __name__ == "__main__":
    try:
        os.nice(10)  # background work: the UI process gets the CPU first on a busy machine
    except (AttributeError, OSError):
        pass
    serve(sys.stdin, sys.stdout)
