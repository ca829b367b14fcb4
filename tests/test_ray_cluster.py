"""runtime.executor: ray against clusters this test starts itself: a two-node cluster simulated on
one host (`ray start --head` plus `ray start --address`, each with its own ports and resources),
and a driver killed mid-run that must leave no process behind.

Slow (each starts Ray from scratch): `-m slow` selects them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ray  # noqa: E402  (the test extra installs it: a broken import fails)

from axrl.runtime.recording.events import read_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
TINY = ["steps=3", "model.preset=micro-moe", "warmup.steps=0", "data.task=echo", "data.task_args={turns: 1}",
        "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        "rollout.max_context_len=128", "rollout.max_batch_size=8", "eval.every=0", "checkpoint.every=1",
        "runtime.threads=1", "algo.entropy_coef=0.05", "runtime.executor=ray"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def axrl_train(run_dir: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"), "--run-dir", str(run_dir)]
    return args + [a for s in [*TINY, *extra] for a in ("--set", s)]


def processes_of(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists()
            and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()}


def ray_processes_started_after(t0: float) -> set[int]:
    """PIDs of ray processes (gcs, raylet, workers) of this user started after `t0`."""
    out = set()
    ticks, boot = os.sysconf("SC_CLK_TCK"), float(Path("/proc/stat").read_text().split("btime ")[1].split()[0])
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            start = boot + int((d / "stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        except (OSError, IndexError, ValueError):
            continue
        if start >= t0 - 1 and ("ray" in cmd and ("gcs_server" in cmd or "raylet" in cmd or "default_worker" in cmd
                                                 or "ray::" in cmd)):
            out.add(int(d.name))
    return out


def test_a_killed_driver_leaves_no_orphan_process(tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    run_dir, t0 = tmp_path / "run", time.time()
    proc = subprocess.Popen(axrl_train(run_dir, "steps=50", "runtime.ray.num_cpus=2", "runtime.ray.heartbeat_s=0.2"),
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and len(list((run_dir / "trace").glob("step_*.h5"))) < 1:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    status = json.loads((run_dir / "status.json").read_text())
    actors = {a["pid"] for a in status["actors"]}
    started = ray_processes_started_after(t0)
    assert actors and actors <= started
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    # Ray's agents alone would linger about a minute; the run's reaper kills them at once.
    deadline = time.time() + 15
    while time.time() < deadline and processes_of(started):
        time.sleep(0.5)
    assert not processes_of(started), [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in processes_of(started)]


def start_node(args: list[str]) -> subprocess.Popen:
    # --block: the node's processes live as long as this one, so the test stops them by its PID.
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_nodes(address: str, n: int, timeout_s: float = 120) -> None:
    code = (f"import ray, time; ray.init(address={address!r}, logging_level='error');\n"
            f"t = time.time()\nwhile len([x for x in ray.nodes() if x['Alive']]) < {n} and time.time() - t < {timeout_s}:"
            " time.sleep(0.5)\nprint(len([x for x in ray.nodes() if x['Alive']]))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=timeout_s + 60)
    assert out.stdout.strip().endswith(str(n)), out.stderr[-2000:]


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start_node(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                       "--include-dashboard=false", f"--node-manager-port={free_port()}",
                       f"--object-manager-port={free_port()}", "--resources={\"head_node\": 1}",
                       f"--ray-client-server-port={free_port()}", "--min-worker-port=20000", "--max-worker-port=20999"])
    procs = [head]
    try:
        wait_nodes(address, 1)
        procs.append(start_node([f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                                 "--resources={\"second_node\": 1}", "--min-worker-port=21000",
                                 "--max-worker-port=21999"]))
        wait_nodes(address, 2)
        yield address
    finally:
        for p in reversed(procs):
            stop(p)


def test_two_node_cluster_spreads_the_train_group_and_the_engine(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(axrl_train(run_dir, f"runtime.ray.address={two_nodes}", "runtime.ray.placement.mode=separate",
                                    "runtime.ray.placement.strategy=SPREAD"),
                         env=ENV, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list((run_dir / "trace").glob("step_*.h5"))) == 3
    started = {e["component"]: e["nodes"] for e in read_events(run_dir) if e["event"] == "actors_started"}
    # One CPU per node: the train rank and the engine can only be placed on different nodes.
    assert len(started["train group"]) == 1 and started["train group"][0] != started["engine"][0]


def test_one_node_too_small_for_strict_pack_fails_naming_the_key(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(axrl_train(run_dir, f"runtime.ray.address={two_nodes}",
                                    "runtime.ray.placement.strategy=STRICT_PACK", "runtime.ray.placement.timeout_s=5"),
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "runtime.ray.placement" in out.stderr and "STRICT_PACK" in out.stderr, out.stderr[-2000:]
    assert not run_dir.exists()


