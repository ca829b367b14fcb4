"""One sample as a token stream: what rollouts and agents produce, the trainer packs and the trace records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

_COLUMNS = {"token_ids": np.int32, "loss_mask": np.uint8, "turn": np.int32, "policy_version": np.int32,
            "rollout_logprob": np.float32}


def _empty(name: str) -> np.ndarray:
    return np.zeros(0, _COLUMNS[name])


@dataclass
class Trajectory:
    """A whole multi-turn episode as one token stream.

    Parallel per-token arrays (length T): `token_ids` (int32); `loss_mask` (uint8) is 1 only for
    tokens the policy generated; `turn` (int32) is the agent turn a token belongs to (0 = the
    initial prompt); `policy_version` (int32) is the weight version that generated it (−1 for
    prompt, tool and environment tokens); `rollout_logprob` (float32) is the engine's logprob for
    generated tokens and NaN elsewhere. `routed_experts` [T, L, k] holds the experts each token was
    routed to as input at rollout (the final token never went through the model: its row is zeros).
    """

    sample_id: int
    group_id: int
    prompt_id: str
    token_ids: np.ndarray = field(default_factory=lambda: _empty("token_ids"))
    loss_mask: np.ndarray = field(default_factory=lambda: _empty("loss_mask"))
    turn: np.ndarray = field(default_factory=lambda: _empty("turn"))
    policy_version: np.ndarray = field(default_factory=lambda: _empty("policy_version"))
    rollout_logprob: np.ndarray = field(default_factory=lambda: _empty("rollout_logprob"))
    routed_experts: np.ndarray | None = None
    prompt_len: int = 0
    num_turns: int = 0
    reward: float = 0.0
    # Per-turn rewards: turn_rewards[k − 1] is turn k's (the env's step reward, or a black-box
    # agent's per-turn reward); `reward` stays the total (it may hold more: a final reward).
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # one of axrl.core.outcomes.FINISH_REASONS
    status: str = "ok"  # one of STATUSES: "failed" (env/tool raised) is kept in the trace, never trained on
    error: str = ""
    continuations: int = 0  # requests interrupted by a weight update and resumed under the new weights
    # Black-box sessions (axrl.agents.proxy): the session, the sample this path forks from (−1:
    # none) and why (axrl.agents.proxy.session.FORK_CAUSES; "" for none), and the drift: the
    # [start, end) token spans where the sample differs from the chat template's rendering of its
    # conversation, and how many tokens differ.
    session_id: str = ""
    fork_of: int = -1
    fork_cause: str = ""
    drift_tokens: int = 0
    drift_spans: list[tuple[int, int]] = field(default_factory=list)
    forks: list["Trajectory"] = field(default_factory=list)  # the session's other paths, pooled with it
    info: dict[str, Any] = field(default_factory=dict)

    def append(self, ids: Sequence[int], *, generated: bool, turn: int, version: int = -1,
               logprobs: Sequence[float] | None = None) -> None:
        """Append a segment; generated segments carry the engine's logprobs and version."""
        n = len(ids)
        if generated and (logprobs is None or len(logprobs) != n):
            raise ValueError(f"generated segment of {n} tokens needs {n} logprobs")
        segment = {
            "token_ids": np.asarray(ids, np.int32).reshape(n),
            "loss_mask": np.full(n, int(generated), np.uint8),
            "turn": np.full(n, turn, np.int32),
            "policy_version": np.full(n, version if generated else -1, np.int32),
            "rollout_logprob": (np.asarray(logprobs, np.float32).reshape(n) if generated
                                else np.full(n, np.nan, np.float32)),
        }
        for name, values in segment.items():
            setattr(self, name, np.concatenate([getattr(self, name), values]))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def check(self) -> None:
        """Raise if the per-token arrays disagree (a bug in an agent loop, never user input)."""
        T = len(self.token_ids)
        for name in _COLUMNS:
            if len(getattr(self, name)) != T:
                raise AssertionError(f"trajectory {self.sample_id}: {name} has {len(getattr(self, name))} "
                                     f"entries for {T} tokens")
        if self.routed_experts is not None and self.routed_experts.shape[0] != T:
            raise AssertionError(f"trajectory {self.sample_id}: routed_experts has "
                                 f"{self.routed_experts.shape[0]} rows for {T} tokens")
