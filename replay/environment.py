"""What bitwise re-execution requires, and how the current environment compares to the recording.

Determinism holds only for the same backend, device kind, torch thread count, config and library
versions as in `manifest.json` (docs/design.md: on these CPUs 1 vs 2 threads already change gradients).
Replay still runs when something differs — the result is then evidence about *that* difference —
but it warns first, so a divergence is not mistaken for a bug.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import torch

from axrl.config import Config
from axrl.trace.run_dir import cpu_facts

REQUIREMENTS = ("same train backend and device kind, same torch thread count, the recorded config.yaml, "
                "and the same torch / python / numpy versions (and axrl source) as in manifest.json")


def _git_sha(where: str) -> str | None:
    """HEAD of the git checkout holding `where` (None outside git), as the manifest records it."""
    try:
        res = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None


def current_environment(cfg: Config, device: str = "cpu") -> dict[str, Any]:
    """The facts of this process that decide whether a re-execution can be bitwise."""
    import axrl

    return {
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "backend": cfg.train.backend,
        "device": device,
        "threads": torch.get_num_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **cpu_facts(),
        "git_sha": _git_sha(os.path.dirname(axrl.__file__)),
        "deterministic": cfg.runtime.deterministic,
        "python_executable": sys.executable,
    }


def environment_warnings(manifest: dict[str, Any], current: dict[str, Any],
                         checkpoint_meta: dict[str, Any] | None = None) -> list[str]:
    """One line per difference between the recording and now that can break bitwise equality."""
    warn: list[str] = []
    if not manifest:
        return ["manifest.json is missing: cannot check that this environment matches the recording"]
    rv = manifest.get("versions") or {}
    for lib in ("torch", "python", "numpy"):
        if rv.get(lib) and current["versions"].get(lib) and rv[lib] != current["versions"][lib]:
            warn.append(f"{lib} version differs: recorded {rv[lib]}, now {current['versions'][lib]}")
    if manifest.get("backend") and manifest["backend"] != current["backend"]:
        warn.append(f"train backend differs: recorded {manifest['backend']}, now {current['backend']}")
    if manifest.get("threads") is not None and manifest["threads"] != current["threads"]:
        warn.append(f"torch threads differ: recorded {manifest['threads']}, now {current['threads']} "
                    "(gradients differ bitwise between thread counts)")
    if checkpoint_meta and checkpoint_meta.get("num_threads") not in (None, current["threads"]):
        warn.append(f"the checkpoint was saved with {checkpoint_meta['num_threads']} torch threads, "
                    f"now {current['threads']}")
    if checkpoint_meta and checkpoint_meta.get("torch_version") not in (None, current["versions"]["torch"]):
        warn.append(f"the checkpoint was saved by torch {checkpoint_meta['torch_version']}, "
                    f"now {current['versions']['torch']}")
    for key, label in (("host", "host"), ("platform", "platform"), ("cpu_count", "CPU count")):
        if manifest.get(key) is not None and manifest[key] != current[key]:
            warn.append(f"{label} differs: recorded {manifest[key]}, now {current[key]} "
                        "(other CPU kernels can round differently)")
    for key, label in (("cpu_model", "CPU model"), ("cpu_capability", "torch CPU dispatch level"),
                       ("cpu_flags", "CPU instruction-set flags (digest)")):
        if manifest.get(key) is not None and manifest[key] != current[key]:
            warn.append(f"{label} differs: recorded {manifest[key]}, now {current[key]} "
                        "(other CPU kernels round differently)")
    if manifest.get("git_sha") and current.get("git_sha") and manifest["git_sha"] != current["git_sha"]:
        warn.append(f"axrl source differs: recorded at git {manifest['git_sha'][:12]}, "
                    f"now {current['git_sha'][:12]}")
    if not current.get("deterministic", True):
        warn.append("the run was recorded with runtime.deterministic=false: bitwise equality is not expected")
    return warn
