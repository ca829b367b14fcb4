"""Processes named so that a reused PID is never mistaken for them: (pid, start time).

Launched servers and the Ray reaper record the processes they may have to kill later, perhaps
from another process; a PID alone could by then belong to something else.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def process_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of a live process, None when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is missing
        return None
    return int(fields[1]), int(fields[19])


def is_running(pid: int, start: int) -> bool:
    """Whether the process that started at `start` with this PID still runs."""
    st = process_stat(pid)
    return st is not None and st[1] == start


def kill_group(pid: int, start: int, timeout: float = 10.0) -> bool:
    """SIGTERM the process group led by (pid, start), SIGKILL it after `timeout`; whether it was
    still running."""
    if not is_running(pid, start):
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not is_running(pid, start):
                return True
            time.sleep(0.05)
    return True
