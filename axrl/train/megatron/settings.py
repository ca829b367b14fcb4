"""`MegatronLayout`: the Megatron backend's parallel layout — the YAML section `train.megatron` is
this type, and `MegatronBackendConfig` is the shared `BackendConfig` plus it (one set of defaults
and one validation for the YAML and Python). Light: pydantic only, no megatron-core."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DISPATCHERS", "MegatronLayout", "auto_data_parallel"]

DISPATCHERS = ("alltoall", "allgather")


def auto_data_parallel(tensor_parallel: int, expert_parallel: int) -> int:
    """The smallest data-parallel size whose world (TP × DP) the experts can be spread over:
    EP / gcd(TP, EP) — 1 when EP divides TP (experts fold into the TP ranks), 2 for TP 1 / EP 2."""
    return expert_parallel // math.gcd(tensor_parallel, expert_parallel)


class MegatronLayout(BaseModel):
    """`train.backend: megatron` layout (docs/megatron.md): world size = tensor_parallel ×
    data_parallel worker processes on one machine (one in-process rank when 1); expert_parallel
    divides it. Megatron's rules (`initialize_model_parallel` with expert TP 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensor_parallel: int = Field(1, ge=1, description="TP size (sequence parallel within it)")
    expert_parallel: int = Field(1, ge=1, description="EP size; must divide tensor_parallel × data_parallel")
    data_parallel: int = Field(0, ge=0, description="DP size; 0 = the smallest that fits expert_parallel: "
                                                    "EP / gcd(TP, EP)")
    sequence_parallel: bool = Field(True, description="required when tensor_parallel > 1")
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"

    @model_validator(mode="after")
    def _layout(self) -> "MegatronLayout":
        tp, ep, dp = self.tensor_parallel, self.expert_parallel, self.data_parallel
        if dp and (tp * dp) % ep:  # EP divides the world size: experts are spread over all ranks
            raise ValueError(f"expert_parallel={ep} must divide tensor_parallel × data_parallel = {tp} × {dp} "
                             f"(the world size); set data_parallel to a multiple of {auto_data_parallel(tp, ep)}, "
                             "or 0 to derive it")
        if tp > 1 and not self.sequence_parallel:
            raise ValueError("tensor_parallel > 1 needs sequence_parallel: true (Megatron MoE + TP training)")
        return self

    def layout(self) -> dict[str, object]:
        """This object's `MegatronLayout` fields, as keyword arguments."""
        return {name: getattr(self, name) for name in MegatronLayout.model_fields}

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel size in use (`data_parallel`, or derived when 0)."""
        return self.data_parallel or auto_data_parallel(self.tensor_parallel, self.expert_parallel)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel_size
