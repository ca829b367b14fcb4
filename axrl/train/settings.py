"""A train backend's settings, one pydantic type per level, one set of defaults and one validation
for the YAML and for Python:

- `TrainSettings`: the optimizer, schedule and micro-batching keys of the YAML section `train`
  (the config's `TrainSection` is this type plus which backend, its layout and LoRA);
- `BackendConfig`: `TrainSettings` plus what the run decides (total updates, seed, threads,
  determinism, compute dtype) and a few Python-only knobs. `TorchBackendConfig` is it plus
  `lora`; `MegatronBackendConfig` adds the parallel layout."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

_Config = TypeVar("_Config", bound="BackendConfig")


class TrainSettings(BaseModel):
    """Optimizer (AdamW), learning-rate schedule and micro-batching: the YAML section `train`'s
    own keys, with their defaults and validation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0, description="AdamW's, on matrices only (not norms), as Megatron does")
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0, description="max total L2 norm of the gradients (0 = off)")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="after warmup_steps")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in optimizer updates")
    micro_batch_tokens: int = Field(4096, ge=0, description="tokens per micro-batch counting padding "
                                                            "(samples × longest; 0 = no limit)")
    prefix_merge: bool = Field(False, description="train each micro-batch as one prefix tree: shared prefixes "
                                                  "computed once (docs/prefix-merge.md); the budget then counts "
                                                  "tree slots")

    def train_settings(self) -> dict[str, Any]:
        """This object's `TrainSettings` fields (a subclass' own left out), as keyword arguments."""
        return {name: getattr(self, name) for name in TrainSettings.model_fields}


class BackendConfig(TrainSettings):
    """Optimizer, schedule, micro-batching and determinism settings of a train backend: the YAML's
    `TrainSettings` plus what the run sets (`axrl.assembly` fills these from `steps`, `seed` and
    `runtime`) and Python-only knobs."""

    eps: float = Field(1e-8, ge=0, description="AdamW's epsilon")
    total_steps: int = Field(0, ge=0, description="updates over which cosine/linear decay to min_lr_ratio")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    micro_batch_size: int = Field(0, ge=0, description="samples per micro-batch; 0 = no limit")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="autocast compute dtype")
    seed: int = 0
    num_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = keep the current count")
    deterministic: bool = True

    @model_validator(mode="after")
    def _schedule_length(self) -> "BackendConfig":
        if self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps > warmup_steps "
                             f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON values (what a checkpoint records)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls: type[_Config], d: dict[str, Any]) -> _Config:
        """The config of `to_dict`'s output; unknown fields are an error."""
        unknown = sorted(set(d) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}")
        return cls(**d)  # a bad value: pydantic's ValidationError, a ValueError
