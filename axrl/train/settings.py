"""`BackendConfig`: the settings every train backend shares — optimizer, learning-rate schedule,
micro-batching, precision and determinism. `TorchBackendConfig` is it as it stands;
`MegatronBackendConfig` adds the parallel layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

_Config = TypeVar("_Config", bound="BackendConfig")


@dataclass
class BackendConfig:
    """Optimizer, schedule, micro-batching and determinism settings of a train backend."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01          # applied to matrices only (not norms), as Megatron does
    grad_clip: float = 1.0              # max total L2 norm; 0 = off
    lr_schedule: str = "constant"       # constant | cosine | linear (after warmup)
    warmup_steps: int = 0
    total_steps: int = 0                # updates over which cosine/linear decay to min_lr_ratio
    min_lr_ratio: float = 0.0
    micro_batch_tokens: int = 0         # real tokens per micro-batch; 0 = no limit
    micro_batch_size: int = 0           # samples per micro-batch; 0 = no limit
    dtype: str = "float32"              # float32 | bfloat16 (autocast compute dtype)
    seed: int = 0
    num_threads: int = 0                # torch intra-op threads; 0 = keep the current count
    deterministic: bool = True
    prefix_merge: bool = False          # one forward over each micro-batch's prefix tree (train/prefix_tree.py)

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # JSON gives a list back
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_schedule must be constant|cosine|linear, got {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps > warmup_steps "
                             f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32|bfloat16, got {self.dtype!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("lr", "eps", "weight_decay", "grad_clip", "warmup_steps", "total_steps",
                     "micro_batch_tokens", "micro_batch_size", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values (what a checkpoint records)."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls: type[_Config], d: dict[str, Any]) -> _Config:
        """The config of `to_dict`'s output; unknown fields are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}")
        return cls(**d)
