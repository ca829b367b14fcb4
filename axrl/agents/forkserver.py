"""ForkServer: start `python agent.py` processes without paying for the interpreter each time.

A Python agent spends most of its start on imports (`import openai` alone is ~1 s of CPU on
the 2-core box this was measured on: 1.2 s user time for a whole agent process), and a training
run starts one per episode: hundreds. The fork server is one fresh interpreter (never a fork of
the trainer, which holds torch's threads) that imports the script's top-level modules once, then
forks a child per episode. The child is the agent's own process as before: its own pid,
environment, working directory, stdin (the prompt), stderr (its tail recorded on failure), exit
code, and a kill on timeout; it runs the script unchanged as `__main__` (`runpy`).

The server preloads the modules the script imports at top level, then the ones its children
go on to import while they run (lazy imports inside libraries: `openai` defers its resource
modules, about half of an agent's remaining CPU time) — each child reports them when it ends,
and later children start with them loaded. Modules of the script's own directory are left to
the child (the server's `sys.path` is not the script's), and a module whose import fails in
the server is simply imported (and fails) in the child. Like any preloading, this assumes the
agent's libraries do nothing at import that a fork would break (start threads, open sockets).

    server = ForkServer("examples/agents/calculator_agent.py")
    proc = server.spawn(["examples/agents/calculator_agent.py"], env, cwd)   # Popen-like
    _, err = proc.communicate(b"What is 2 + 3?", timeout=60)
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The server's code, run as `python -c`: it must import nothing of AxRL (the agent's interpreter).
_SERVER = r'''
import gc, json, os, runpy, select, signal, socket, sys, traceback
sock = socket.socket(fileno=int(sys.argv[1]))
tried = set()
def preload(names):
    for name in names:
        if name not in sys.modules and name not in tried:
            tried.add(name)
            try:
                __import__(name)
            except BaseException:
                pass
    gc.freeze()  # a child's collections skip the preloaded objects (no copy-on-write of them)
preload(json.loads(sys.argv[2]))
# Children report the modules they imported at run time (lazy imports: ~half of an openai
# agent's CPU); the server imports them too, so later children start with them loaded.
learn_r, learn_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
def learnable(module, script_dir):
    path = getattr(module, "__file__", None)
    return bool(path) and not os.path.abspath(path).startswith(script_dir + os.sep)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
sock.sendall(b'{"ready": true}\n')
def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
while True:
    ready, _, _ = select.select([sock, wake_r, learn_r], [], [])
    if wake_r in ready:
        os.read(wake_r, 4096)
        reap()
    if learn_r in ready:
        preload(json.loads(learn_r.recv(1 << 20)))
    if sock not in ready:
        continue
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 2)
    except OSError:  # the trainer closed its end (or died)
        break
    if not msg:
        break
    job = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fds[0], 0)
            os.dup2(devnull, 1)
            os.dup2(fds[1], 2)
            for fd in (*fds, devnull, wake_r, wake_w):
                os.close(fd)
            sock.close()
            learn_r.close()
            loaded = set(sys.modules)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.clear()
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            sys.argv = job["argv"]
            sys.path[0] = os.path.dirname(os.path.abspath(job["argv"][0]))
            code = 0
            try:
                runpy.run_path(job["argv"][0], run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            script_dir = os.path.dirname(os.path.abspath(job["argv"][0]))
            new = [n for n, m in list(sys.modules.items())
                   if n not in loaded and n not in tried and learnable(m, script_dir)]
            if new:
                try:
                    learn_w.send(json.dumps(new).encode())
                except OSError:
                    pass
        except BaseException:
            code = 1
        os._exit(code)
    for fd in fds:
        os.close(fd)
    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
'''


def top_level_imports(script: str | Path) -> list[str]:
    """The modules `script` imports at its top level (what the fork server preloads)."""
    tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != "__future__":
            names.append(node.module)
    return list(dict.fromkeys(names))


class ForkServer:
    """One preloaded interpreter for `script`; `spawn` forks an agent process from it."""

    def __init__(self, script: str | Path, python: str = sys.executable, startup_timeout_s: float = 60.0) -> None:
        # SEQPACKET: one request per message (an environment can be long), replies one line each.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen([python, "-c", _SERVER, str(theirs.fileno()),
                                       json.dumps(top_level_imports(script))],
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._lock = threading.Lock()                  # one spawn at a time: pid replies come in order
        self._pids: list[concurrent.futures.Future] = []
        self._exits: dict[int, concurrent.futures.Future] = {}
        self._early: dict[int, int] = {}               # exit codes that came before their waiter
        self._state = threading.Lock()
        self._ready = concurrent.futures.Future()
        self._reader = threading.Thread(target=self._read, name="axrl-agent-forkserver", daemon=True)
        self._reader.start()
        self._ready.result(timeout=startup_timeout_s)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> "ForkedProcess":
        """Fork `argv` (`[script, args...]`) with `env`; a Popen-like handle (stdin and stderr piped)."""
        stdin_r, stdin_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        job = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}).encode()
        try:
            with self._lock:
                pid_future: concurrent.futures.Future = concurrent.futures.Future()
                with self._state:
                    self._pids.append(pid_future)
                socket.send_fds(self._sock, [job], [stdin_r, stderr_w])
                pid = pid_future.result(timeout=30)
        finally:
            os.close(stdin_r)
            os.close(stderr_w)
        with self._state:
            exit_future = self._exits.setdefault(pid, concurrent.futures.Future())
            if pid in self._early:
                exit_future.set_result(self._early.pop(pid))
        return ForkedProcess(pid, stdin_w, stderr_r, exit_future)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                error = RuntimeError("the agent fork server exited")
                with self._state:
                    for f in [*self._pids, *self._exits.values(), self._ready]:
                        if not f.done():
                            f.set_exception(error)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                with self._state:
                    if "ready" in msg:
                        self._ready.set_result(True)
                    elif "pid" in msg:
                        self._pids.pop(0).set_result(msg["pid"])
                    elif msg["exit"] in self._exits:
                        self._exits.pop(msg["exit"]).set_result(msg["code"])
                    else:
                        self._early[msg["exit"]] = msg["code"]


class ForkedProcess:
    """An agent forked by the server, with the slice of `subprocess.Popen` the player uses."""

    def __init__(self, pid: int, stdin_w: int, stderr_r: int, exit_future: concurrent.futures.Future) -> None:
        self.pid, self.returncode = pid, None
        self._stdin, self._stderr, self._exit = stdin_w, stderr_r, exit_future
        self._err = bytearray()

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[None, bytes]:
        """Send `input`, collect stderr until the process exits; `subprocess.TimeoutExpired` past
        `timeout` (call again, e.g. after `kill`, for the rest)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._stdin >= 0:
            try:
                if input:
                    os.write(self._stdin, input)  # a prompt: far below the pipe's buffer
            except BrokenPipeError:
                pass
            os.close(self._stdin)
            self._stdin = -1
        if self._stderr >= 0:
            with selectors.DefaultSelector() as sel:
                sel.register(self._stderr, selectors.EVENT_READ)
                while True:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise subprocess.TimeoutExpired("agent", timeout or 0)
                    if not sel.select(left):
                        continue
                    chunk = os.read(self._stderr, 1 << 16)
                    if not chunk:
                        break
                    self._err += chunk
            os.close(self._stderr)
            self._stderr = -1
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.returncode = self._exit.result(timeout=left)
        except concurrent.futures.TimeoutError:
            raise subprocess.TimeoutExpired("agent", timeout or 0) from None
        return None, bytes(self._err)

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the agent and anything it started (its own session)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, signal.SIGKILL)  # not yet in its own session
            except (ProcessLookupError, PermissionError):
                pass

    def __del__(self) -> None:
        for fd in (self._stdin, self._stderr):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def forkable(argv: list[str]) -> str | None:
    """The script of a plain `python script.py [args...]` command (what a fork server can run), else None."""
    if len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py") and Path(argv[1]).is_file():
        return argv[1]
    return None
