"""Deterministic mode and pickle-free RNG state capture.

Deterministic mode (docs/design.md) = fixed seeds + fixed thread count + deterministic algorithms.
RNG states are split into tensors (saved with safetensors) and plain JSON values, so a
checkpoint never needs unpickling to be restored.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def set_determinism(seed: int, num_threads: int | None = None, deterministic: bool = True) -> None:
    """Seed python/numpy/torch, fix the intra-op thread count and pick deterministic kernels.

    The thread count matters on CPU: gradients differ bitwise between 1 and 2 threads, so it
    is part of what makes two runs reproduce each other. `num_threads` None/0 keeps the current
    count (still recorded by callers so replays can match it).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if num_threads:
        torch.set_num_threads(num_threads)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic)


@dataclass
class RngState:
    """Global RNG states: `tensors` (torch generators) go to safetensors, `meta` to JSON."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def capture_rng_state() -> RngState:
    """Snapshot the python `random`, numpy and torch (CPU, and CUDA if initialised) RNGs."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    meta = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        # json writes floats with repr(), so cached_gaussian round-trips exactly.
        "numpy": {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    return RngState(tensors, meta)


def restore_rng_state(state: RngState) -> None:
    """Inverse of `capture_rng_state`; raises ValueError on a malformed state."""
    try:
        py, npy = state.meta["python"], state.meta["numpy"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), int(npy["pos"]),
                             int(npy["has_gauss"]), float(npy["cached_gaussian"])))
        torch.set_rng_state(state.tensors["torch_cpu"].to(torch.uint8).cpu())
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"malformed RNG state: {e!r}") from e
    cuda_keys = sorted((k for k in state.tensors if k.startswith("torch_cuda_")), key=lambda k: int(k[11:]))
    cuda = [state.tensors[k] for k in cuda_keys]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
