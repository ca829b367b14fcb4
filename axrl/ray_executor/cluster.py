"""Import Ray, connect to a cluster or start a local one; fail early and name the key.

A bad `runtime.ray.address` is reported before `ray.init` (which would otherwise retry for a
long time): the head's GCS port must accept a TCP connection.
"""

from __future__ import annotations

import os
import socket
from types import ModuleType

from axrl.core.errors import ConfigError
from axrl.ray_executor.settings import RaySettings

RAY_EXTRA = "pip install 'axrl[ray]'"


def import_ray() -> ModuleType:
    """The `ray` module, or a ConfigError naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"runtime.executor: ray needs Ray, which is not installed: {RAY_EXTRA}") from e
    return ray


def check_address(address: str, timeout_s: float = 3.0) -> None:
    """Refuse an address that is not host:port or where nothing listens (naming the key)."""
    if address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if address.startswith("ray://") or not sep or not host or not port.isdigit():
        raise ConfigError(f"runtime.ray.address: {address!r} is not host:port of a Ray head (e.g. 127.0.0.1:6379), "
                          "'auto', or null to start a local cluster")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"runtime.ray.address: no Ray head answers at {address} ({e}); start one with "
                          f"`ray start --head --port {port}` or set runtime.ray.address: null for a local cluster") from e


def worker_env() -> dict[str, str]:
    """Environment of the actors: one OpenMP thread unless the driver says otherwise (torch threads
    are set per actor from `runtime.threads`)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def connect(r: RaySettings) -> ModuleType:
    """Connect to `runtime.ray.address` or start a local cluster (reusing one this process already
    joined, e.g. in tests). Returns the `ray` module."""
    ray = import_ray()
    if r.address is not None:
        check_address(r.address)  # also when this process already joined a cluster: the key must be right
    if ray.is_initialized():
        return ray
    env = {"env_vars": worker_env()}
    if r.address is not None:
        try:
            ray.init(address=r.address, runtime_env=env, logging_level="warning", log_to_driver=False)
        except Exception as e:  # noqa: BLE001 — Ray raises several types here; all mean the same to the user
            raise ConfigError(f"runtime.ray.address: cannot join the Ray cluster at {r.address}: "
                              f"{type(e).__name__}: {e}") from e
        return ray
    # address="local": always a new cluster of its own, never one found running on this host.
    ray.init(address="local", num_cpus=r.num_cpus, include_dashboard=False, runtime_env=env, logging_level="warning",
             log_to_driver=False, _node_ip_address="127.0.0.1")
    return ray
