"""What a rollout produces: one token-level trajectory per sample, ready to pack and to trace."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "context", "max_turns", "abort", "failed")


@dataclass
class Trajectory:
    """A whole multi-turn episode as one token stream.

    Parallel per-token lists (length T): `loss_mask` is 1 only for tokens the policy generated;
    `turn` is the agent turn a token belongs to (0 = the initial prompt); `policy_version` is the
    weight version that generated it (−1 for prompt, tool and environment tokens);
    `rollout_logprob` is the engine's logprob for generated tokens and NaN elsewhere.
    `routed_experts` [T, L, k] holds the experts each token was routed to as input at rollout
    (the final token never went through the model: its row is zeros).
    """

    sample_id: int
    group_id: int
    prompt_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    rollout_logprob: list[float] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    prompt_len: int = 0
    num_turns: int = 0
    reward: float = 0.0
    finish_reason: str = "stop"
    status: str = "ok"  # "ok" | "failed" (env/tool raised; kept in the trace, never trained on)
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def append(self, ids: list[int], *, generated: bool, turn: int, version: int = -1,
               logprobs: list[float] | None = None) -> None:
        """Append a segment; generated segments carry the engine's logprobs and version."""
        n = len(ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * n)
        self.turn.extend([turn] * n)
        self.policy_version.extend(([version] if generated else [-1]) * n)
        if generated:
            if logprobs is None or len(logprobs) != n:
                raise ValueError(f"generated segment of {n} tokens needs {n} logprobs")
            self.rollout_logprob.extend(float(x) for x in logprobs)
        else:
            self.rollout_logprob.extend([math.nan] * n)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def check(self) -> None:
        """Raise if the per-token lists disagree (a bug in an agent loop, never user input)."""
        T = len(self.token_ids)
        for name in ("loss_mask", "turn", "policy_version", "rollout_logprob"):
            if len(getattr(self, name)) != T:
                raise AssertionError(f"trajectory {self.sample_id}: {name} has {len(getattr(self, name))} "
                                     f"entries for {T} tokens")
        if self.routed_experts is not None and self.routed_experts.shape[0] != T:
            raise AssertionError(f"trajectory {self.sample_id}: routed_experts has "
                                 f"{self.routed_experts.shape[0]} rows for {T} tokens")
