"""Each optim_step of a service model closes a trace step: the datums' tokens, loss mask, the
sampler's logprobs (`/tokens/rollout_logprob`, where the client sent them), the trainer's logprobs
from forward_backward (`/tokens/old_logprob`: the weights before the update), advantages (for
cross_entropy: the datum weights), entropy, losses, grad norms and weight fingerprints — the
same step file `axrl train` writes, plus the calls and AdamW parameters replay re-runs
(`training.CALLS_ATTR`, `training.OPTIM_ATTR`). The server does not know rewards or groups:
/samples/reward is NaN and each datum is its own group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from axrl.runtime.results import UpdateResult

from axrl.runtime.recording.builders import metric_columns
from axrl.tinker_api.training import CALLS_ATTR, OPTIM_ATTR, CallSpec
from axrl.trace.quantities import mean_abs_delta
from axrl.trace.step_record import StepRecord
from axrl.train.protocol import PackedBatch, TrainMetrics


@dataclass
class CallRouting:
    """The MoE routing of a call's tokens: the engine's where the datum is a sequence the service
    sampled (`valid`), and the trainer's at the weights the call trained."""

    rollout: np.ndarray     # int16 [T, L, k]; zeros where not valid
    valid: np.ndarray       # uint8 [T]
    train: np.ndarray       # int16 [T, L, k]
    num_experts: int


@dataclass
class RecordedCall:
    """A gradient-accumulating call as it ran: its batch (old logprobs set), metrics and routing."""

    spec: CallSpec
    batch: PackedBatch
    metrics: TrainMetrics
    routing: CallRouting | None = None


def _step_routing(calls: list[RecordedCall]) -> dict[str, Any]:
    """StepRecord routing fields: only when every call of the step has its routing (a step
    mixing sampled and other datums records none, rather than a routing with holes)."""
    routed = [c.routing for c in calls]
    if not routed or any(r is None for r in routed):
        return {}
    return {"num_experts": routed[0].num_experts,
            "routing_rollout": np.concatenate([r.rollout for r in routed]),
            "routing_rollout_valid": np.concatenate([r.valid for r in routed]),
            "routing_train": np.concatenate([r.train for r in routed])}


def _cat(batches: list[PackedBatch], name: str) -> np.ndarray:
    return torch.cat([getattr(b, name) for b in batches]).numpy()


def step_record(step: int, calls: list[RecordedCall], update: UpdateResult, fingerprint_before: str,
                adam: dict[str, float], wall_times: dict[str, float]) -> StepRecord:
    """The trace record of one service step."""
    batches = [c.batch for c in calls]
    lengths = np.concatenate([b.lengths.numpy() for b in batches])
    offsets = np.cumsum(np.concatenate([[0], lengths])).astype(np.int64)
    n, mask = len(lengths), _cat(batches, "loss_mask").astype(np.uint8)
    rollout = _cat(batches, "rollout_logprobs")
    prompt_len = [int(np.argmax(mask[a:b] > 0)) if mask[a:b].any() else int(b - a)
                  for a, b in zip(offsets[:-1], offsets[1:])]
    m, s = update.metrics, update.stats
    update_row = {"loss": m.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                  **{k: v for k, v in m.metrics.items() if k != "loss"}}
    entropy = torch.cat([c.metrics.tokens["entropy"] for c in calls]).numpy()
    return StepRecord(
        step=step, policy_version=step, sample_offsets=offsets, sample_id=np.arange(n), group_id=np.arange(n),
        prompt_id=[f"{c.spec.loss_fn}:{i}" for c in calls for i in range(c.spec.start, c.spec.end)],
        prompt_len=prompt_len, num_turns=np.ones(n, np.int32), reward=np.full(n, np.nan),
        finish_reason=["stop"] * n, status=["ok"] * n,
        token_ids=_cat(batches, "input_ids"), loss_mask=mask, turn=np.zeros(int(offsets[-1]), np.int16),
        token_policy_version=np.where(np.isnan(rollout), -1, step).astype(np.int32),
        rollout_logprob=rollout, old_logprob=_cat(batches, "old_logprobs"), advantage=_cat(batches, "advantages"),
        entropy=entropy.astype(np.float16),
        param_names=list(s.param_grad_norm), param_grad_norm=np.asarray([list(s.param_grad_norm.values())]),
        update_sample_offsets=np.asarray([0, n]), update_samples=np.arange(n),
        update_metrics=metric_columns([update_row]),
        micro_batch_metrics=metric_columns([{"update": 0, **r} for r in m.micro_batches]),
        update_fingerprints=[update.fingerprint],
        weights_fingerprint_before=fingerprint_before, weights_fingerprint_after=update.fingerprint,
        wall_times=wall_times,
        attrs={CALLS_ATTR: json.dumps([c.spec.to_json() for c in calls]), OPTIM_ATTR: json.dumps(adam),
               "source_api": "tinker"},
        **_step_routing(calls),
    )


def metrics_row(r: StepRecord, update: UpdateResult, extra: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics.jsonl line."""
    return {"step": int(r.step), "policy_version": int(r.policy_version), "samples": r.num_samples,
            "tokens": r.num_tokens, "generated_tokens": int(np.asarray(r.loss_mask).sum()),
            "mismatch": mean_abs_delta(np.asarray(r.loss_mask), r.rollout_logprob, r.old_logprob),
            "loss": update.metrics.loss, "grad_norm": update.stats.grad_norm, "lr": update.stats.lr, **extra}
