"""The local cluster never outlives its driver, even a SIGKILLed one.

Ray's own processes fate-share with the driver that started them, but two of its agents (the
runtime-env and dashboard agents) notice their raylet is gone only about a minute later. The
reaper is a small process of its own session, started when the driver starts a local cluster:
while the driver lives it keeps a snapshot (refreshed every second) of the driver's descendant
processes; when its stdin closes — the driver shut the cluster down, or died — it kills those
still running (same PID *and* start time, so a reused PID is never hit).

    python -m axrl.ray_executor.reaper DRIVER_PID
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from axrl.core.processes import is_running, process_stat


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every process below `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = process_stat(int(d.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(d.name))
                starts[int(d.name)] = st[1]
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = starts[c]
                todo.append(c)
    return out


def main(driver: int) -> None:
    me = os.getpid()
    seen = {p: s for p, s in descendants(driver).items() if p != me}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the driver closed the pipe or died
        seen.update({p: s for p, s in descendants(driver).items() if p != me})
    for pid, start in seen.items():
        if is_running(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start_reaper() -> subprocess.Popen:
    """Start the reaper for this process (the driver); close its stdin to make it reap now."""
    return subprocess.Popen([sys.executable, "-m", "axrl.ray_executor.reaper", str(os.getpid())],
                            stdin=subprocess.PIPE, start_new_session=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
