"""Start, watch, restart and stop rollout server processes (SGLang, vLLM or `axrl serve`).

`command` is the argv prefix that starts ONE server; the launcher appends
`<model_flag> P --host H --port N` and `server_args`. Defaults to
`python -m sglang.launch_server` with `--model-path`; `axrl serve` takes the same flags, the CPU
compatibility wrapper (`axrl/inference/sglang/cpu_compat.py` run by the SGLang venv's python)
passes them on, and vLLM's `vllm.entrypoints.openai.api_server` is started with `--model`.
Every server answers `GET /health` with 200 once it serves.

A crashed server is restarted on the same port by `ensure_alive(i)` (called by the client when a
request to it fails, and by the optional watchdog thread); the restart counter per server lets
the client notice a restart and re-apply the latest weights before re-sending its requests.

Servers run in sessions of their own (so `stop()` reaches the workers SGLang forks), which means
they survive a launcher killed with SIGKILL — a Ray rollout actor that died, a trainer killed by
the OOM killer. Each launched server therefore leaves a claim (`CLAIMS_DIR/<port>.json`: its
and its launcher's PID and start time), and `start()` first stops the servers whose launcher is
gone, so a restarted launcher gets its ports and memory back instead of finding them taken.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import httpx

from axrl.core.processes import is_running, kill_group, process_stat

CLAIMS_DIR = Path(tempfile.gettempdir()) / f"axrl-servers-{os.getuid()}"
TAIL_LINES = 400       # lines of output kept per server without a log_dir
START_MARK = "==== start #"  # the line the launcher writes into a server's output before each start


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host:port` right now (with SO_REUSEADDR, as uvicorn and
    SGLang bind: connections of a stopped server lingering in TIME_WAIT do not take the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free now (a later bind may still race another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """A server process exited or never became healthy; the message holds its log tail."""


class _Server:
    def __init__(self, index: int, port: int, log_path: Path | None) -> None:
        self.index, self.port, self.log_path = index, port, log_path
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.lock = threading.Lock()
        self.log_file = None
        self.exit_code: int | None = None  # of the process before the current one (a crash or a relaunch)
        # used when there is no log file: enough to hold a crashed process's traceback and the
        # start-up lines of the process that replaced it
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.pump: threading.Thread | None = None   # copies the current process's output into `tail`
        self.pumped = 0                             # lines it has copied (`tail` is capped)


class ServerLauncher:
    """Launches `num_servers` server processes on consecutive free ports from `base_port`.

    Args:
        model_path: HF model directory every server loads at start.
        command: argv prefix that starts one server (default `python -m sglang.launch_server`).
        model_flag: the flag that gives the server its model directory (vLLM: `--model`).
        server_args: extra flags for every server, e.g. `["--enable-return-routed-experts"]`.
        env: extra environment variables for the servers (on top of this process's).
        startup_timeout_s: how long a server may take to answer `GET /health` with 200.
        log_dir: where each server's stdout+stderr goes (`server_<i>.log`); default: kept in memory
            (the last lines are quoted in errors).
        watchdog_s: if > 0, a thread checks the processes this often and restarts crashed ones.
    """

    def __init__(self, model_path: str | Path, *, num_servers: int = 1, host: str = "127.0.0.1",
                 base_port: int = 30000, server_args: Sequence[str] = (), command: Sequence[str] | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 180.0,
                 log_dir: str | Path | None = None, watchdog_s: float = 0.0, model_flag: str = "--model-path") -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path {model_path} is not a directory (an HF model directory is needed)")
        self.model_path, self.host = str(model_path), host
        self.num_servers, self.base_port = num_servers, base_port
        self.server_args = [str(a) for a in server_args]
        self.command = list(command) if command else [sys.executable, "-m", "sglang.launch_server"]
        self.model_flag = model_flag
        # `axrl serve` exits when this process dies (SGLang servers must be stopped by stop()).
        self.env = {**os.environ, "AXRL_PARENT_PID": str(os.getpid()), **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self.watchdog_s = watchdog_s
        self._servers: list[_Server] = []
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self._servers))]

    def url(self, i: int) -> str:
        return f"http://{self.host}:{self._servers[i].port}"

    def start(self) -> list[str]:
        """Start every server and wait until all are healthy; returns their URLs."""
        if self._servers:
            raise RuntimeError("ServerLauncher.start() was already called")
        stop_orphaned_servers()
        port = self.base_port
        for i in range(self.num_servers):
            while not port_is_free(self.host, port):
                port += 1
            log = self.log_dir / f"server_{i}.log" if self.log_dir else None
            self._servers.append(_Server(i, port, log))
            port += 1
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for s in self._servers:
                self._spawn(s)
            deadline = time.monotonic() + self.startup_timeout_s
            for s in self._servers:  # they start concurrently; wait for each
                self._wait_healthy(s, deadline)
        except BaseException:
            self.stop()
            raise
        if self.watchdog_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name="axrl-server-watchdog", daemon=True)
            self._watchdog.start()
        return self.urls

    def argv(self, i: int) -> list[str]:
        """The command line of server `i`."""
        s = self._servers[i]
        return [*self.command, self.model_flag, self.model_path, "--host", self.host, "--port", str(s.port),
                *self.server_args]

    def _spawn(self, s: _Server) -> None:
        if s.process is not None:
            s.exit_code = s.process.poll()
        if s.pump is not None:   # the old process's last lines belong above the new start mark
            s.pump.join(timeout=2.0)
        mark = f"{START_MARK}{s.restarts}: {' '.join(self.argv(s.index))}"
        if s.log_path is not None:
            s.log_file = open(s.log_path, "ab")  # noqa: SIM115 — lives as long as the process
            s.log_file.write(f"\n{mark}\n".encode())
            s.log_file.flush()
            out = s.log_file
        else:
            s.tail.append(mark)
            out = subprocess.PIPE
        # A new session: stop() can signal the server and any workers it forked (SGLang does).
        s.process = subprocess.Popen(self.argv(s.index), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        _write_claim(s.port, s.process.pid)
        if out is subprocess.PIPE:
            s.pump = threading.Thread(target=self._pump, args=(s, s.process), daemon=True)
            s.pump.start()

    @staticmethod
    def _pump(s: _Server, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            s.tail.append(line.decode(errors="replace").rstrip())
            s.pumped += 1

    def _output(self, i: int) -> list[str]:
        """The end of server `i`'s output (its log file's last 256 KiB, or the lines kept in memory),
        start marks included."""
        s = self._servers[i]
        if s.log_path is not None and s.log_path.is_file():
            with open(s.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - (256 << 10)))
                return f.read().decode(errors="replace").splitlines()
        self._drain(s)
        return list(s.tail)

    @staticmethod
    def _drain(s: _Server, quiet_s: float = 0.05, limit_s: float = 2.0) -> None:
        """Let the pump copy what the process has printed so far: a server prints its error before
        it answers, so the error can still sit in the pipe when the answer is quoted. Waits for the
        pump's end when the process exited, else until the output is quiet for `quiet_s`."""
        if s.pump is None:
            return
        deadline = time.monotonic() + limit_s
        if s.process is not None and s.process.poll() is not None:
            s.pump.join(timeout=limit_s)
            return
        seen = -1
        while s.pumped != seen and time.monotonic() < deadline and s.pump.is_alive():
            seen = s.pumped
            time.sleep(quiet_s)

    def log_tail(self, i: int, lines: int = 20) -> str:
        """The last lines server `i`'s current process printed."""
        out = self._output(i)
        starts = [k for k, line in enumerate(out) if line.startswith(START_MARK)]
        return "\n".join(out[starts[-1] + 1 if starts else 0:][-lines:])

    def failure_report(self, i: int, lines: int = 30) -> str:
        """What a request error should quote about server `i`: where it is, and the last lines of
        its output — also those of the process before the current one when that one exited (the
        crash a retry restarted it after, or the process a weight-sync restart replaced)."""
        s = self._servers[i]
        where = f"server {i} ({self.url(i)}, pid {self.pid(i)}, {s.restarts} restart(s)" + \
            (f", log {s.log_path})" if s.log_path else ")")
        out = self._output(i)
        starts = [k for k, line in enumerate(out) if line.startswith(START_MARK)]
        current = out[starts[-1] + 1 if starts else 0:]
        state = "running" if self.alive(i) else f"exited with code {s.process.poll() if s.process else None}"
        previous = out[(starts[-2] + 1 if len(starts) >= 2 else 0):starts[-1]] if starts and starts[-1] > 0 else []
        text = f"{where}, {state}"
        errors = first_errors(previous + current)
        if errors:   # a crash's root cause sits above the tracebacks of every request it failed
            text += "; the first errors it printed:\n" + "\n".join(errors)
        text += "\nits last output:\n" + ("\n".join(current[-lines:]) or "(none)")
        if previous:
            text += (f"\nits previous process (exit code {s.exit_code}) ended with:\n"
                     + "\n".join(previous[-lines:]))
        return text

    def _wait_healthy(self, s: _Server, deadline: float) -> None:
        url = f"http://{self.host}:{s.port}/health"
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = s.process.poll() if s.process else None
                if code is not None:
                    raise ServerStartError(f"server {s.index} ({' '.join(self.argv(s.index))}) exited with code "
                                           f"{code} before becoming healthy; last output:\n{self.log_tail(s.index)}")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(f"server {s.index} at {url} not healthy after {self.startup_timeout_s:.0f} s "
                                           f"(startup_timeout_s); last output:\n{self.log_tail(s.index)}")
                time.sleep(0.2)

    def alive(self, i: int) -> bool:
        """Whether server `i`'s process is still running."""
        p = self._servers[i].process
        return p is not None and p.poll() is None

    def restarts(self, i: int) -> int:
        """How many times server `i` was restarted."""
        return self._servers[i].restarts

    def pid(self, i: int) -> int | None:
        p = self._servers[i].process
        return p.pid if p is not None else None

    def ensure_alive(self, i: int) -> bool:
        """Restart server `i` (same port, same flags) if its process has exited and wait until it is
        healthy. Returns True if it restarted it. Safe to call from many threads at once: one restarts,
        the others wait for it."""
        s = self._servers[i]
        with s.lock:
            if self._stopping.is_set() or self.alive(i):
                return False
            self._close_log(s)
            s.restarts += 1
            self._spawn(s)
            self._wait_healthy(s, time.monotonic() + self.startup_timeout_s)
            return True

    def relaunch(self, servers: Sequence[int], model_path: str | Path) -> None:
        """Restart `servers` on the HF directory `model_path` (same ports and flags) and wait until
        they are healthy: the weight route of servers that cannot load new weights in place. Not
        counted as restarts (the client gives no resync for it); later restarts load `model_path`."""
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path {model_path} is not a directory (an HF model directory is needed)")
        self.model_path = str(model_path)
        chosen = [self._servers[i] for i in servers]
        for s in chosen:
            with s.lock:
                self._terminate(s)
                self._close_log(s)
                self._spawn(s)
        deadline = time.monotonic() + self.startup_timeout_s
        for s in chosen:
            self._wait_healthy(s, deadline)

    @staticmethod
    def _terminate(s: _Server, timeout: float = 15.0) -> None:
        """SIGTERM server `s`'s process group, SIGKILL after `timeout`, and reap it."""
        p = s.process
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def kill(self, i: int) -> None:
        """SIGKILL server `i` (tests and fault drills); the next `ensure_alive(i)` restarts it."""
        p = self._servers[i].process
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def _watch(self) -> None:
        while not self._stopping.wait(self.watchdog_s):
            for i in range(len(self._servers)):
                if not self.alive(i):
                    try:
                        self.ensure_alive(i)
                    except ServerStartError:
                        pass  # retried on the next tick; clients see the failures meanwhile

    @staticmethod
    def _close_log(s: _Server) -> None:
        if s.log_file is not None:
            s.log_file.close()
            s.log_file = None

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate every server (SIGTERM, then SIGKILL after `timeout`)."""
        self._stopping.set()
        for s in self._servers:
            p = s.process
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for s in self._servers:
            p = s.process
            if p is None:
                continue
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            self._close_log(s)
            _claim_path(s.port).unlink(missing_ok=True)

    def __enter__(self) -> "ServerLauncher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .+")


def first_errors(lines: Sequence[str], limit: int = 3) -> list[str]:
    """The first `limit` distinct exception lines (`SomeError: message`) of a server's output,
    without the logger's prefix: the root cause of a crash, which the tracebacks of the requests it
    then failed push out of the last lines."""
    seen: list[str] = []
    for line in lines:
        m = _ERROR_LINE.search(line)
        if m and m.group(0) not in seen:
            seen.append(m.group(0))
            if len(seen) == limit:
                break
    return seen


def _claim_path(port: int) -> Path:
    return CLAIMS_DIR / f"{port}.json"


def _write_claim(port: int, pid: int) -> None:
    me, server = process_stat(os.getpid()), process_stat(pid)
    if me is None or server is None:
        return  # the server already exited: nothing to stop later
    CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
    tmp = _claim_path(port).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": pid, "start": server[1], "launcher": os.getpid(), "launcher_start": me[1]}))
    tmp.replace(_claim_path(port))


def stop_orphaned_servers() -> list[int]:
    """Stop the servers on this host whose launcher died without stopping them (SIGTERM to their
    process group, SIGKILL after 10 s) and drop stale claims; the PIDs stopped."""
    stopped: list[int] = []
    if not CLAIMS_DIR.is_dir():
        return stopped
    for path in CLAIMS_DIR.glob("*.json"):
        try:
            claim = json.loads(path.read_text())
            pid, start, launcher, launcher_start = (int(claim[k]) for k in ("pid", "start", "launcher", "launcher_start"))
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if is_running(launcher, launcher_start):
            continue  # a live launcher's server (this run's or another's)
        if kill_group(pid, start):
            stopped.append(pid)
        path.unlink(missing_ok=True)
    return stopped
