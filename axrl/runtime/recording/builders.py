"""Step records: what one trained step produced, turned into its trace record and its metrics.jsonl line."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from axrl.core.trajectory import Trajectory
from axrl.rollout.pool import Batch
from axrl.train.critic import critic_metrics
from axrl.runtime.results import TrainedStep, UpdateResult
from axrl.trace import StepRecord
from axrl.trace.quantities import analysed_mask, delta, mean_abs_delta


#: Root attrs of a step file trained with a critic (`critic_attrs`; replay compares them).
CRITIC_ATTRS = ("critic_fingerprint_before", "critic_fingerprint_after", "critic_value_loss", "critic_updates")


def mismatch(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |trainer − rollout logprob| over analysed tokens: the headline mismatch scalar, by the
    definition ``axrl-debug`` reports as ``mean_abs`` (``axrl.trace.quantities.mean_abs_delta``)."""
    return mean_abs_delta(mask.numpy(), rollout_logprobs.numpy(), old_logprobs.numpy())


def teacher_kl(o: TrainedStep) -> dict[str, float]:
    """{"teacher_kl": k1 estimate of KL(student ‖ teacher), mean(rollout − teacher logprob) over the
    analysed tokens — `axrl-debug mismatch --against teacher`'s KL k1} for a distillation step."""
    teacher = o.processed.teacher_logprobs
    if teacher is None:
        return {}
    batch = o.processed.batch
    rollout, t = batch.rollout_logprobs.numpy(), teacher.numpy()
    mask = analysed_mask(batch.loss_mask.numpy(), rollout, t)
    return {"teacher_kl": float(-delta(rollout[mask], t[mask]).mean()) if mask.any() else math.nan}


def step_metrics(o: TrainedStep) -> dict[str, Any]:
    """The step's metrics.jsonl line."""
    trajs = o.processed.trajectories
    batch = o.processed.batch
    ok = [t for t in trajs if t.status == "ok"]
    step_s = sum(o.wall_times.values())
    last = o.updates[-1]
    lag = o.batch.version_lag()
    split = {}
    if o.behaviour is not None:
        split = {"mismatch_engine": mismatch(o.behaviour, batch.rollout_logprobs, batch.loss_mask),
                 "mismatch_staleness": mismatch(o.old.logprobs, o.behaviour, batch.loss_mask)}
    return {
        "step": o.step,
        "policy_version": o.policy_version,
        "reward": float(np.mean([t.reward for t in ok])) if ok else math.nan,
        "reward_max": float(max((t.reward for t in ok), default=math.nan)),
        "loss": float(np.mean([u.metrics.loss for u in o.updates])),
        "grad_norm": float(np.mean([u.stats.grad_norm for u in o.updates])),
        "grad_norm_max": float(np.max([u.stats.grad_norm for u in o.updates])),
        "lr": last.stats.lr,
        "clipfrac": float(np.mean([u.metrics.metrics.get("clipfrac", math.nan) for u in o.updates])),
        "mismatch": mismatch(o.old.logprobs, batch.rollout_logprobs, batch.loss_mask),
        **split,
        **teacher_kl(o),
        **_critic_metrics(o),
        "entropy": float((o.old.entropy * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)),
        "samples": len(trajs),
        "failed": len(trajs) - len(ok),
        "tokens": batch.num_tokens,
        "generated_tokens": int(sum(t.num_generated for t in trajs)),
        "mean_turns": float(np.mean([t.num_turns for t in trajs])),
        "tokens_per_s": sum(t.num_generated for t in trajs) / step_s if step_s > 0 else math.nan,
        "version_lag_mean": float(lag.mean()) if lag.size else math.nan,
        "version_lag_max": int(lag.max()) if lag.size else 0,
        "stale_dropped": len(o.batch.dropped),
        "stale_reruns": len(o.batch.reruns),
        "step_time": step_s,
        **{f"time_{k}": v for k, v in o.wall_times.items()},
        "finish_reasons": {r: sum(t.finish_reason == r for t in trajs) for r in sorted({t.finish_reason for t in trajs})},
        "dropped_groups": o.processed.dropped_groups,   # dynamic sampling (0 when off)
        **_session_metrics(trajs),
    }


def _critic_metrics(o: TrainedStep) -> dict[str, float]:
    """value_loss, value_clip_frac, explained_variance, critic_grad_norm, critic_lr (with a critic)."""
    p = o.processed
    if o.critic is None or p.values is None or p.returns is None:
        return {}
    return critic_metrics(o.critic.updates, p.values, p.returns, p.batch.loss_mask)


def critic_attrs(o: TrainedStep) -> dict[str, Any]:
    """The step file's critic attrs (`CRITIC_ATTRS`): fingerprints, the updates' value losses
    (float64 reprs, space-separated, in order: replay compares them bit for bit) and their count."""
    if o.critic is None:
        return {}
    c = o.critic
    return {"critic_fingerprint_before": c.fingerprint_before, "critic_fingerprint_after": c.fingerprint_after,
            "critic_value_loss": " ".join(repr(float(u.value_loss)) for u in c.updates),
            "critic_updates": len(c.updates)}


def _session_metrics(trajs: list[Trajectory]) -> dict[str, Any]:
    """Black-box agent sessions of the batch: how many, their forks and re-tokenisation drift
    (also reported for white-box episodes whose template re-renders history, e.g. Qwen3)."""
    if not any(t.session_id or t.drift_tokens for t in trajs):
        return {}
    return {"sessions": len({t.session_id for t in trajs if t.session_id}),
            "session_forks": sum(t.fork_of >= 0 for t in trajs),
            "session_fork_causes": {c: sum(t.fork_of >= 0 and t.fork_cause == c for t in trajs)
                                    for c in sorted({t.fork_cause for t in trajs if t.fork_of >= 0})},
            "drift_samples": sum(t.drift_tokens > 0 for t in trajs),
            "drift_tokens": int(sum(t.drift_tokens for t in trajs))}


def _columns(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Rows of metrics → one array per key (NaN where a row lacks it; counts stay integers)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = {}
    for k in keys:
        values = [r.get(k, math.nan) for r in rows]
        is_count = k in ("update",) or k.startswith("num_")
        out[k] = np.asarray(values, dtype=np.int64 if is_count and all(v == v for v in values) else np.float64)
    return out


metric_columns = _columns   # the same columns for other drivers of the learner (axrl/tinker_api/recording.py)


def _routing(trajs: list, batch_routing: torch.Tensor | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    if batch_routing is None:
        return None, None
    # The final token of each trajectory never went through the engine: its row is not valid.
    valid = np.concatenate([np.r_[np.ones(t.num_tokens - 1, np.uint8), np.zeros(1, np.uint8)] for t in trajs])
    return batch_routing.numpy(), valid


def _token_rows(offsets: np.ndarray, samples: list[int]) -> np.ndarray:
    """Token indices of `samples` (rows of the step's batch), in that order."""
    return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in samples]) if samples else np.zeros(0, int)


def objective_columns(o: TrainedStep) -> dict[str, np.ndarray | None]:
    """/tokens/is_weight and /tokens/loss_rule [T] from each update's per-token loss columns
    (a token is trained by the update that holds its sample; NaN / 0 where not trained); None
    for a column the loss did not report in every update."""
    batch = o.processed.batch
    T = batch.num_tokens
    off = batch.offsets.numpy()
    trained = batch.loss_mask.numpy() > 0
    empty = {"is_weight": (np.float32, np.nan), "loss_rule": (np.uint16, 0)}
    out: dict[str, np.ndarray | None] = {}
    for name, (dtype, fill) in empty.items():
        if not o.updates or any(name not in u.metrics.tokens for u in o.updates):
            out[name] = None
            continue
        col = np.full(T, fill, dtype)
        for u in o.updates:
            col[_token_rows(off, u.samples)] = u.metrics.tokens[name].numpy().astype(dtype)
        col[~trained] = fill
        out[name] = col
    return out


def param_grad_norms(updates: list[UpdateResult]) -> tuple[list[str] | None, np.ndarray | None]:
    """(/train/param_names, /train/param_grad_norm [U, P]) from the updates' StepStats (None when
    the backend reported none)."""
    names = list(updates[0].stats.param_grad_norm) if updates else []
    if not names or any(list(u.stats.param_grad_norm) != names for u in updates):
        return None, None
    return names, np.asarray([list(u.stats.param_grad_norm.values()) for u in updates], np.float64)


def agent_columns(trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """Per-sample numbers an agent function returned (``t.info["columns"]``, e.g. a verifiers
    environment's reward components ``reward.correct``): one column per name, NaN for samples
    without it (failed episodes, forks of other sessions)."""
    names = sorted({k for t in trajs for k in t.info.get("columns", {})})
    return {k: np.asarray([t.info.get("columns", {}).get(k, np.nan) for t in trajs], np.float64) for k in names}


def step_record(o: TrainedStep, rng_digest: str = "", routing: bool = True) -> StepRecord:
    """The step's trace record (schema: docs/trace-format.md); `routing=False` leaves out /routing."""
    trajs = o.processed.trajectories
    batch = o.processed.batch
    routing_rollout, routing_valid = _routing(trajs, batch.routed_experts if routing else None)
    routing_train = o.old.routed_experts if routing else None
    update_samples = [i for u in o.updates for i in u.samples]
    update_offsets = np.cumsum([0] + [len(u.samples) for u in o.updates])
    update_rows = [{"loss": u.metrics.loss, "grad_norm": u.stats.grad_norm, "lr": u.stats.lr,
                    **{k: v for k, v in u.metrics.metrics.items() if k != "loss"}} for u in o.updates]
    mb_rows = [{"update": ui, **row} for ui, u in enumerate(o.updates) for row in u.metrics.micro_batches]
    objective = objective_columns(o)
    param_names, param_norms = param_grad_norms(o.updates)
    extra_samples = {"advantage": o.processed.sample_advantages.numpy(),
                     "continuations": np.asarray([t.continuations for t in trajs], np.int32)}
    if o.processed.penalties is not None:
        extra_samples["overlong_penalty"] = o.processed.penalties
    extra_samples.update(agent_columns(trajs))
    return StepRecord(
        step=o.step,
        policy_version=o.policy_version,
        sample_offsets=batch.offsets.numpy(),
        sample_id=[t.sample_id for t in trajs],
        group_id=[t.group_id for t in trajs],
        prompt_id=[t.prompt_id for t in trajs],
        prompt_len=[t.prompt_len for t in trajs],
        num_turns=[t.num_turns for t in trajs],
        reward=[t.reward for t in trajs],
        finish_reason=[t.finish_reason for t in trajs],
        status=[t.status for t in trajs],
        error=[t.error for t in trajs],
        token_ids=batch.input_ids.numpy(),
        loss_mask=batch.loss_mask.numpy().astype(np.uint8),
        turn=np.concatenate([t.turn for t in trajs]),
        token_policy_version=np.concatenate([t.policy_version for t in trajs]),
        rollout_logprob=batch.rollout_logprobs.numpy(),
        old_logprob=o.old.logprobs.numpy(),
        advantage=batch.advantages.numpy(),
        entropy=o.old.entropy.numpy(),
        ref_logprob=None if batch.ref_logprobs is None else batch.ref_logprobs.numpy(),
        is_weight=objective["is_weight"],
        loss_rule=objective["loss_rule"],
        param_names=param_names,
        param_grad_norm=param_norms,
        update_sample_offsets=update_offsets,
        update_samples=update_samples,
        update_metrics=_columns(update_rows),
        micro_batch_metrics=_columns(mb_rows),
        update_fingerprints=[u.fingerprint for u in o.updates],
        weights_fingerprint_before=o.fingerprint_before,
        weights_fingerprint_after=o.fingerprint_after,
        num_experts=(o.num_experts or None) if routing else None,
        routing_rollout=routing_rollout,
        routing_rollout_valid=routing_valid,
        routing_train=None if routing_train is None else routing_train.numpy(),
        behaviour_train_logprob=None if o.behaviour is None else o.behaviour.numpy(),
        turn_reward=o.processed.turn_rewards,
        value=None if o.processed.values is None else o.processed.values.numpy(),
        returns=None if o.processed.returns is None else o.processed.returns.numpy(),
        **_pool_columns(o.batch, o.processed.dropped, routing),
        **_session_columns(trajs),
        extra_samples=extra_samples,
        extra_tokens=({} if o.processed.teacher_logprobs is None
                      else {"teacher_logprob": o.processed.teacher_logprobs.numpy()}),   # on-policy distillation
        wall_times=o.wall_times,
        rng_digest=rng_digest,
        attrs={**o.marks, **critic_attrs(o)},
    )


def _session_columns(trajs: list[Trajectory]) -> dict[str, Any]:
    """/samples/{session_id, fork_of, fork_cause, drift_tokens} and /tokens/drift: only when a
    black-box agent made the batch or a white-box episode drifted (its template re-renders
    history: session_id '' then)."""
    if not any(t.session_id or t.drift_tokens for t in trajs):
        return {}
    return {"session_id": [t.session_id for t in trajs], "fork_of": [t.fork_of for t in trajs],
            "fork_cause": [t.fork_cause for t in trajs], "drift_tokens": [t.drift_tokens for t in trajs],
            "drift": np.concatenate([_drift_mask(t) for t in trajs])}


def _drift_mask(traj: Trajectory) -> np.ndarray:
    """1 on the tokens of the trajectory's drift spans."""
    mask = np.zeros(traj.num_tokens, np.uint8)
    for start, end in traj.drift_spans:
        mask[start:end] = 1
    return mask


DYNAMIC_SAMPLING = "dynamic_sampling"   # /pool/dropped_reason of the groups dynamic sampling did not select


def _pool_columns(batch: Batch, dropped: list[Trajectory], routing: bool = True) -> dict[str, Any]:
    """The /pool datasets of a step: only when something was dropped or re-run. Groups the pool
    dropped (staleness) are listed; groups dynamic sampling dropped are listed with their samples
    (/pool/samples, /pool/tokens, /pool/routing), which were rolled out for this step but never trained."""
    out: dict[str, Any] = {}
    ids = [f.group_id for f in batch.dropped]
    reasons = [f.reason for f in batch.dropped]
    versions = [f.min_version for f in batch.dropped]
    for g in dict.fromkeys(t.group_id for t in dropped):
        generated = [int(v) for t in dropped if t.group_id == g for v in np.asarray(t.policy_version) if v >= 0]
        ids.append(g)
        reasons.append(DYNAMIC_SAMPLING)
        versions.append(min(generated, default=-1))
    if ids:
        out.update(pool_dropped_group_id=ids, pool_dropped_reason=reasons, pool_dropped_min_version=versions)
    if batch.reruns:
        out["pool_rerun_group_id"] = list(batch.reruns)
    if dropped:
        out.update(_pool_samples(dropped, routing))
    return out


def _pool_samples(trajs: list[Trajectory], routing: bool) -> dict[str, Any]:
    """/pool/samples and /pool/tokens (and /pool/routing/rollout for MoE) of never-trained samples."""
    lengths = [t.num_tokens for t in trajs]
    out: dict[str, Any] = dict(
        pool_sample_offsets=np.cumsum([0] + lengths), pool_sample_id=[t.sample_id for t in trajs],
        pool_group_id=[t.group_id for t in trajs], pool_prompt_id=[t.prompt_id for t in trajs],
        pool_prompt_len=[t.prompt_len for t in trajs], pool_num_turns=[t.num_turns for t in trajs],
        pool_reward=[t.reward for t in trajs], pool_finish_reason=[t.finish_reason for t in trajs],
        pool_status=[t.status for t in trajs],
        pool_token_ids=np.concatenate([np.asarray(t.token_ids) for t in trajs]),
        pool_turn=np.concatenate([np.asarray(t.turn) for t in trajs]),
        pool_token_policy_version=np.concatenate([np.asarray(t.policy_version) for t in trajs]),
        pool_rollout_logprob=np.concatenate([np.asarray(t.rollout_logprob, np.float32) for t in trajs]))
    if routing and all(t.routed_experts is not None for t in trajs):
        rows = []
        for t in trajs:  # the final token of each trajectory never went through the engine: stored as zeros
            r = np.asarray(t.routed_experts).astype(np.int64)
            r[-1:] = 0
            rows.append(r)
        out["pool_routing_rollout"] = np.concatenate(rows)
    return out
