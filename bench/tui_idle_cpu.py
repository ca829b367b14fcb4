"""CPU used by `axrl-debug tui` while nothing changes, in a real terminal (tmux, 80×24).

Opens the synthetic 1,000-step run of bench/tui_open.py in the installed console script, waits
until the background scan has finished, then measures the UI process's CPU time over
``--seconds`` of idleness on the steps view and on the tokens view of a sample (the views with
sparklines, a table and the token text). The target is < 2 % of a core. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.tui_open import make_run  # noqa: E402
from test_tui_tmux import SCRIPT, TMUX, Pane, _cpu_seconds, _tui_pid, helper_running  # noqa: E402


def idle_share(pid: int, seconds: float) -> float:
    c0, t0 = _cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    if TMUX is None or SCRIPT is None:
        print(json.dumps({"error": "needs tmux and the installed axrl-debug console script"}))
        return
    run = Path(tempfile.mkdtemp()) / "idle-run"
    make_run(run, args.steps)
    pane = Pane([SCRIPT, "tui", str(run)])
    try:
        pane.wait_for(f"{args.steps} steps", timeout=120)
        pid = _tui_pid(run)
        deadline = time.monotonic() + 600
        while not helper_running(pid) and time.monotonic() < deadline:  # started after the first paint
            time.sleep(0.1)
        while helper_running(pid) and time.monotonic() < deadline:  # the background scan is done when it exits
            time.sleep(0.5)
        time.sleep(3.0)  # the last scan chunk's repaint and spike re-detection
        steps_view = idle_share(pid, args.seconds)
        pane.send("Enter")
        pane.wait_for("samples")
        pane.send("Enter")
        pane.wait_for("prompt · not trained")
        time.sleep(3.0)
        tokens_view = idle_share(pid, args.seconds)
    finally:
        pane.kill()
    print(f"idle CPU over {args.seconds:g} s: steps view {steps_view:.2%}, tokens view {tokens_view:.2%} of a core")
    print(json.dumps({"steps": args.steps, "idle_cpu_steps_view": round(steps_view, 4),
                      "idle_cpu_tokens_view": round(tokens_view, 4)}))


if __name__ == "__main__":
    main()
