"""Where the embedded model runs: ``runtime.device`` (cpu | cuda | cuda:i) for the torch trainer
and the embedded engine, which hold their weights on the same device."""

from __future__ import annotations

import os
import re

import torch

# runtime.device: the device kinds the torch trainer and the embedded engine run on.
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


def resolve_device(spec: str) -> torch.device:
    """The torch device of ``runtime.device``, checked against this machine and this torch build."""
    if not re.match(DEVICE_PATTERN, spec):
        raise ValueError(f"runtime.device {spec!r} is not a device: use cpu, cuda or cuda:N")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"runtime.device {spec!r}: torch {torch.__version__} sees no CUDA device "
                             "(a CPU build, or no GPU/driver here); use runtime.device: cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"runtime.device {spec!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
        # cuBLAS is deterministic only with a fixed workspace, set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device("cuda", index)
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's weights are on."""
    return next(model.parameters()).device
