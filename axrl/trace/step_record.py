"""`StepRecord`: everything one step file holds, as the caller gives it (arrays of any
`np.asarray`-able kind). `axrl.trace.prepare` validates it against the schema and converts it to
the stored dtypes; `axrl.trace.writer` writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np


__all__ = ["StepRecord"]


@dataclass
class StepRecord:
    """Everything recorded about one step. See docs/trace-format.md for the meaning of each field.

    N samples are stored row-wise; their tokens are concatenated (T total) and located by
    ``sample_offsets`` (int64 [N+1], offsets[0] = 0, offsets[-1] = T, non-decreasing). Arrays may
    be anything ``np.asarray`` accepts (CPU torch tensors included); they are cast to the schema
    dtype when that is lossless for integers (range-checked) and allowed for floats.
    """

    step: int
    policy_version: int                      # trainer weight version before this step's updates
    # ---- samples [N]
    sample_offsets: Any                      # int64 [N+1]
    sample_id: Any                           # int64 [N]
    group_id: Any                            # int64 [N]
    prompt_id: Sequence[str]                 # str [N]
    prompt_len: Any                          # int32 [N]
    num_turns: Any                           # int32 [N]
    reward: Any                              # float64 [N]
    finish_reason: Sequence[str]             # str [N]
    status: Sequence[str]                    # str [N] 'ok' | 'failed'
    # ---- tokens [T]
    token_ids: Any                           # int32 [T]
    loss_mask: Any                           # uint8 [T]
    turn: Any                                # int16 [T]
    token_policy_version: Any                # int32 [T], -1 = prompt/env token
    rollout_logprob: Any                     # float32 [T], NaN where not generated
    old_logprob: Any                         # float32 [T]
    advantage: Any                           # float32 [T]
    entropy: Any                             # float16 [T]
    # ---- train: composition of each optimizer update, metrics, fingerprints
    update_sample_offsets: Any               # int64 [U+1] CSR over update_samples
    update_samples: Any                      # int64 [S] row indices into the samples
    update_metrics: Mapping[str, Any]        # name -> [U]; needs loss, grad_norm, lr
    weights_fingerprint_before: str
    weights_fingerprint_after: str
    # ---- optional
    error: Sequence[str] | None = None       # str [N]; None = '' everywhere
    ref_logprob: Any = None                  # float32 [T], frozen reference policy
    is_weight: Any = None                    # float32 [T], correction weight applied (NaN: not trained)
    loss_rule: Any = None                    # uint16 [T], LOSS_RULE_CODES bits
    param_names: Sequence[str] | None = None  # str [P]
    param_grad_norm: Any = None              # float64 [U, P], per-tensor gradient norm per update
    behaviour_train_logprob: Any = None      # float32 [T]
    num_experts: int | None = None           # required when routing is given
    routing_rollout: Any = None              # [T, L, k] expert ids (as input), engine
    routing_rollout_valid: Any = None        # uint8 [T]; rows with 0 are stored as zeros
    routing_train: Any = None                # [T, L, k] expert ids (as input), trainer
    micro_batch_metrics: Mapping[str, Any] = field(default_factory=dict)  # name -> [M]; update, loss, num_tokens
    micro_batch_sample_offsets: Any = None   # int64 [M+1] CSR over micro_batch_samples
    micro_batch_samples: Any = None          # int64 [MS] row indices into the samples
    update_fingerprints: Sequence[str] | None = None  # str [U], fingerprint after each update
    pool_dropped_group_id: Any = None        # int64 [D]   groups dropped while the batch was filled
    pool_dropped_reason: Sequence[str] | None = None  # str [D]
    pool_dropped_min_version: Any = None     # int32 [D]
    pool_rerun_group_id: Any = None          # int64 [R]   groups re-run while the batch was filled
    # the samples of dropped groups (dynamic sampling): CSR over their own tokens [DT]
    pool_sample_offsets: Any = None          # int64 [DN+1]
    pool_sample_id: Any = None               # int64 [DN]
    pool_group_id: Any = None                # int64 [DN]
    pool_prompt_id: Sequence[str] | None = None  # str [DN]
    pool_prompt_len: Any = None              # int32 [DN]
    pool_num_turns: Any = None               # int32 [DN]
    pool_reward: Any = None                  # float64 [DN]
    pool_finish_reason: Sequence[str] | None = None  # str [DN]
    pool_status: Sequence[str] | None = None  # str [DN]
    pool_token_ids: Any = None               # int32 [DT]
    pool_turn: Any = None                    # int16 [DT]
    pool_token_policy_version: Any = None    # int32 [DT]
    pool_rollout_logprob: Any = None         # float32 [DT]
    pool_routing_rollout: Any = None         # [DT, L, k] expert ids (as input), engine; needs num_experts
    session_id: Sequence[str] | None = None  # str [N]   black-box agent sessions ('' white-box)
    fork_of: Any = None                      # int64 [N] sample a session path forks from (-1: none)
    fork_cause: Sequence[str] | None = None  # str [N]   why a session path forks ('' for none)
    drift_tokens: Any = None                 # int32 [N] tokens differing from the template's rendering
    drift: Any = None                        # uint8 [T] 1 in the drift spans of a session's sample
    turn_reward: Any = None                  # float64 [T] reward of the token's turn (per-turn rewards)
    value: Any = None                        # float32 [T] PPO critic's value (algo.advantage: gae)
    returns: Any = None                      # float32 [T] GAE's return, the critic's target
    wall_times: Mapping[str, float] = field(default_factory=dict)  # phase -> seconds
    rng_digest: str = ""
    attrs: Mapping[str, Any] = field(default_factory=dict)          # extra root attrs (scalars)
    extra_samples: Mapping[str, Any] = field(default_factory=dict)  # /samples/<name> [N, ...]
    extra_tokens: Mapping[str, Any] = field(default_factory=dict)   # /tokens/<name> [T, ...]

    @property
    def num_samples(self) -> int:
        return len(np.asarray(self.sample_offsets)) - 1

    @property
    def num_tokens(self) -> int:
        off = np.asarray(self.sample_offsets)
        return int(off[-1]) if off.size else 0
