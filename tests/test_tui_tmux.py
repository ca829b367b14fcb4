"""The installed `axrl-debug` console script in a real terminal: tmux runs `axrl-debug tui RUN` at
80×24, the test sends keys and asserts on the captured pane, then quits with q — what a user does
over SSH. Skipped (with the reason) where tmux or the console script is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from test_tui_trace import build_run

TMUX = shutil.which("tmux")
SCRIPT = shutil.which("axrl-debug") or (
    str(Path(sys.executable).with_name("axrl-debug")) if Path(sys.executable).with_name("axrl-debug").exists()
    else None)

pytestmark = [
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install -y tmux); "
                                            "the real-terminal test needs it"),
    pytest.mark.skipif(SCRIPT is None, reason="the axrl-debug console script is not installed "
                                              "(pip install -e .)"),
]


class Pane:
    """One tmux server (own socket, so nothing of the user's tmux is touched) with one session."""

    def __init__(self, command: list[str], width: int = 80, height: int = 24) -> None:
        self.socket = f"axrl-tui-test-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, TERM="xterm-256color")
        env.pop("TMUX", None)
        cmd = " ".join(_quote(c) for c in command)
        self._tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height), cmd, env=env)
        self.socket_path = self._tmux("display-message", "-p", "#{socket_path}", check=False).strip()

    def _tmux(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        res = subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, env=env,
                             timeout=30)
        if check and res.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def capture(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t", check=False)

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, *texts: str, timeout: float = 60.0) -> str:
        """The pane once it shows every one of ``texts`` (the terminal is painted in pieces, so
        one string on screen does not mean the rest is); fails with the last screen otherwise."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if all(t in screen for t in texts):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{texts!r} did not all appear within {timeout} s; screen:\n{screen}")

    def back_to(self, text: str, tries: int = 4) -> str:
        """Press escape until ``text`` shows (each press waits for the screen to settle)."""
        for _ in range(tries - 1):
            self.send("Escape")
            try:
                return self.wait_for(text, timeout=15.0)
            except AssertionError:
                continue
        self.send("Escape")
        return self.wait_for(text)

    def alive(self) -> bool:
        return subprocess.run([TMUX, "-L", self.socket, "has-session", "-t", "t"], capture_output=True,
                              timeout=30).returncode == 0

    def kill(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
        if self.socket_path:  # tmux leaves the socket file behind
            Path(self.socket_path).unlink(missing_ok=True)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def test_console_script_in_tmux(tmp_path: Path) -> None:
    run = build_run(tmp_path / "demo-run")
    pane = Pane([SCRIPT, "tui", str(run)])
    try:
        pane.wait_for("axrl-debug — demo-run", "6 steps", "step↑", "mean|Δ|", "q quit")
        pane.send("Enter", "Enter")                              # typed ahead: must not crash
        pane.wait_for("step 0 · v0 · 3 samples")
        # the second enter may open sample 0 a moment later (how far a typed-ahead key reaches
        # depends on how fast the screens compose), so go back until the steps table shows
        pane.back_to("6 steps")
        # background spike detection arrived: step 5's loss spike, flagged in the table
        pane.wait_for("1 with spikes", "L▲")
        pane.send("Enter")                                       # step 0 → its samples
        pane.wait_for("step 0 · v0 · 3 samples", "(1 failed)")
        pane.send("Enter")                                       # sample 0 → its tokens
        pane.wait_for("prompt · not trained", "turn 1 · assistant · trained", "tool/env output")
        pane.send("w")                                           # jump to the worst token
        pane.wait_for("worst #1 of 19", "' answer'", "Δ 0.7", "ratio 2.0138")
        pane.send("d")                                           # next routing disagreement
        pane.wait_for("1/2 layers differ", "L1 3,4≠3,5")
        pane.send("?")
        pane.wait_for("Everywhere")                             # the help screen
        pane.send("q")                                           # q quits, from anywhere
        deadline = time.monotonic() + 30
        while pane.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pane.alive(), f"still running after q:\n{pane.capture()}"
    finally:
        pane.kill()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def _tui_pid(run: Path) -> int:
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"tui" in cmd and str(run).encode() in cmd and any(b"python" in c for c in cmd):
            return int(proc.name)
    raise AssertionError(f"no axrl-debug tui process for {run}")


def helper_running(pid: int) -> bool:
    """Whether the TUI's background helper process (``axrl_debug.tui.helper``) is still alive."""
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and int(stat[1]) == pid and b"axrl_debug.tui.helper" in cmd:
            return True
    return False



@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
def test_idle_tui_uses_almost_no_cpu(tmp_path: Path) -> None:
    """Nothing changes on screen → the UI process sleeps: < 2 % of a core over 3 s, on the steps
    view and on the tokens view (measured here: 0–0.2 %; bench/tui_idle_cpu.py on 1,000 steps: ≤ 0.2 %)."""
    run = build_run(tmp_path / "demo-run")
    pane = Pane([SCRIPT, "tui", str(run)])
    try:
        pane.wait_for("6 steps", "1 with spikes")
        pid = _tui_pid(run)
        deadline = time.monotonic() + 60
        while helper_running(pid) and time.monotonic() < deadline:  # the background scan ends with it
            time.sleep(0.2)
        for keys, shown in (((), "6 steps"), (("Enter",), "3 samples"), (("Enter",), "prompt · not trained")):
            if keys:
                pane.send(*keys)
            pane.wait_for(shown)
            if shown == "3 samples":
                continue
            time.sleep(1.0)                                  # let the last repaint finish
            c0, t0 = _cpu_seconds(pid), time.monotonic()
            time.sleep(3.0)
            share = (_cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            assert share < 0.02, f"idle TUI used {share:.1%} of a core on {shown!r}"
    finally:
        pane.kill()
