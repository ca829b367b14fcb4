"""The agent service: `POST /v1/trajectories` for agents that run their own generation.

An agent with its own engine sends finished token-level trajectories; each is validated against
the tokenizer and the trace schema (a 400 naming the field) and handed to the run's sink (the
TrajectoryPool) like any other sample:

    {"group_id": 7, "token_ids": [...], "loss_mask": [0, 0, 1, ...], "logprobs": [null, ..., -0.3],
     "reward": 1.0, "prompt_len": 12, "policy_version": 3 (or one per token), "routing": [[[e, ...]]],
     "prompt_id": "q7", "finish_reason": "stop", "turn": [0, 0, 1, ...]}

`logprobs` has one entry per token: a finite logprob where `loss_mask` is 1 (the behaviour
policy's, needed by the off-policy corrections), null elsewhere. `policy_version` (≤ the run's
current version) is what the staleness bound checks. A group is complete — and can be trained —
once `rollout.group_size` trajectories with its `group_id` arrived. Ids live in their own range
(`EXTERNAL_ID_BASE` + …) so they never collide with the prompt stream's.

Only the run's agents may push: the request's `Authorization: Bearer <key>` must hold the service's
own key (`AgentService.api_key`) or the key of a live session of the proxy (the `OPENAI_API_KEY`
every agent of the run is started with); anything else is a 401 (`SessionRegistry.authorize_agent`).
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
from typing import Any, Callable

import numpy as np

from axrl.core.outcomes import FINISH_REASONS
from axrl.core.trajectory import Trajectory
from axrl.inference.openai.errors import ApiError, bad
from axrl.tokenizer import Tokenizer

EXTERNAL_ID_BASE = 1 << 40
_FIELDS = {"group_id", "token_ids", "loss_mask", "logprobs", "reward", "prompt_len", "policy_version", "routing",
           "prompt_id", "finish_reason", "turn"}


def _int_list(body: dict[str, Any], key: str, n: int | None, lo: int, hi: int) -> list[int]:
    v = body.get(key)
    if not isinstance(v, list) or not v and n is None:
        raise bad(key, "must be a non-empty list of integers")
    if n is not None and len(v) != n:
        raise bad(key, f"has {len(v)} entries for {n} tokens")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x < hi:
            raise bad(f"{key}[{i}]", f"must be an integer in [{lo}, {hi}), got {x!r}")
    return v


class AgentService:
    """Validates pushed trajectories and passes them to `sink` (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, sink: Callable[[Trajectory], Any], *,
                 current_version: Callable[[], int], max_context_len: int,
                 routing_shape: tuple[int, int, int] | None = None) -> None:
        self.tokenizer, self.sink, self.current_version = tokenizer, sink, current_version
        # (layers, top_k, experts): ModelConfig.routing_shape(), the shape the engine's routing has
        self.max_context_len, self.routing_shape = max_context_len, routing_shape
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # POST /v1/trajectories needs "Bearer <api_key>" (or a live session's key): the run's agent key
        self.api_key = "sk-axrl-agent-" + secrets.token_urlsafe(24)

    def validate(self, body: Any) -> Trajectory:
        """The trajectory of `body`, or an ApiError(400) naming the offending field."""
        if not isinstance(body, dict):
            raise ApiError(400, "the /v1/trajectories body must be a JSON object")
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise bad(unknown[0], f"unknown field (expected {sorted(_FIELDS)})")
        gid = body.get("group_id")
        if isinstance(gid, bool) or not isinstance(gid, int) or not 0 <= gid < EXTERNAL_ID_BASE:
            raise bad("group_id", f"must be an integer in [0, 2^40), got {gid!r}")
        ids = _int_list(body, "token_ids", None, 0, self.tokenizer.vocab_size)
        n = len(ids)
        if n > self.max_context_len:
            raise bad("token_ids", f"{n} tokens exceed rollout.max_context_len={self.max_context_len}")
        mask = _int_list(body, "loss_mask", n, 0, 2)
        if not any(mask):
            raise bad("loss_mask", "no token to train (all zeros)")
        lps = body.get("logprobs")
        if not isinstance(lps, list) or len(lps) != n:
            raise bad("logprobs", f"must be a list of {n} entries (one per token)")
        logprobs = np.full(n, np.nan, np.float32)
        for i, (m, lp) in enumerate(zip(mask, lps)):
            if m:
                if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 0:
                    raise bad(f"logprobs[{i}]", f"a trained token needs a finite logprob <= 0, got {lp!r}")
                logprobs[i] = lp
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise bad("reward", f"must be a finite number, got {reward!r}")
        prompt_len = body.get("prompt_len", mask.index(1))
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 0 <= prompt_len <= mask.index(1):
            raise bad("prompt_len", f"must be an integer in [0, {mask.index(1)}] (before the first trained token)")
        current = self.current_version()
        pv = body.get("policy_version", current)
        versions = [pv] * n if isinstance(pv, int) and not isinstance(pv, bool) else pv
        versions = _int_list({"policy_version": versions}, "policy_version", n, -1, current + 1)
        turn = _int_list(body, "turn", n, 0, 1 << 15) if body.get("turn") is not None else None
        finish = body.get("finish_reason", "stop")
        if finish not in FINISH_REASONS:
            raise bad("finish_reason", f"must be one of {list(FINISH_REASONS)}, got {finish!r}")
        prompt_id = body.get("prompt_id", f"external-{gid}")
        if not isinstance(prompt_id, str):
            raise bad("prompt_id", "must be a string")
        routing = self._routing(body.get("routing"), n)
        with self._lock:
            sid = EXTERNAL_ID_BASE + next(self._ids)
        traj = Trajectory(sample_id=sid, group_id=EXTERNAL_ID_BASE + gid, prompt_id=prompt_id)
        m = np.asarray(mask, np.uint8)
        traj.token_ids, traj.loss_mask = np.asarray(ids, np.int32), m
        traj.turn = np.asarray(turn if turn is not None else np.cumsum(np.diff(m, prepend=0) == 1) * 1, np.int32)
        traj.policy_version = np.where(m == 1, np.asarray(versions, np.int32), -1).astype(np.int32)
        traj.rollout_logprob = logprobs
        traj.routed_experts = routing
        traj.prompt_len, traj.reward, traj.finish_reason = prompt_len, float(reward), finish
        traj.num_turns = int(traj.turn.max()) if n else 0
        traj.session_id = f"external-{gid}"
        traj.check()
        return traj

    def _routing(self, value: Any, n: int) -> np.ndarray | None:
        if value is None:
            return None
        if self.routing_shape is None:
            raise bad("routing", "this model is dense: send no routing")
        layers, top_k, experts = self.routing_shape
        try:
            a = np.asarray(value, dtype=np.int64)
        except (ValueError, TypeError):
            raise bad("routing", "must be a [tokens, layers, top_k] array of expert ids") from None
        if a.shape != (n, layers, top_k):
            raise bad("routing", f"has shape {list(a.shape)}, expected [{n}, {layers}, {top_k}] (tokens, layers, top_k)")
        if a.size and (a.min() < 0 or a.max() >= experts):
            raise bad("routing", f"expert ids must be in [0, {experts})")
        return a.astype(np.int32)

    def push(self, body: Any) -> Trajectory:
        traj = self.validate(body)
        try:
            self.sink(traj)
        except ValueError as e:  # e.g. the group already has its group_size samples
            raise ApiError(409, f"group_id: {e}", param="group_id") from None
        return traj
