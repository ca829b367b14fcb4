"""The training part of a service step, shared by the server and by replay.

A Tinker step is any number of forward_backward calls (each with its own loss), whose gradients
accumulate, then one optim_step with the call's own AdamW parameters. The server runs `run_call`
as each call arrives and `apply_optim` at optim_step; replay re-runs exactly these two functions
on the batches rebuilt from the trace (`replay_service_step`), so bitwise agreement tests the
recording.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from axrl.runtime.results import UpdateResult
from axrl.tinker_api.errors import UserError
from axrl.tinker_api.losses import ServiceLoss
from axrl.train.metrics import reduce_microbatch_metrics
from axrl.train.protocol import AdamHyper, ForwardResult, PackedBatch, StepStats, TrainBackend, TrainMetrics

#: step-file root attributes of a service step (JSON strings)
CALLS_ATTR = "service_calls"
OPTIM_ATTR = "service_optim"
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@dataclass
class CallSpec:
    """One gradient-accumulating forward_backward of a step: its loss and its samples [start, end)."""

    loss_fn: str
    config: dict[str, float]
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"loss_fn": self.loss_fn, "config": self.config, "samples": [self.start, self.end]}


def run_call(backend: TrainBackend, batch: PackedBatch, loss_fn: str, config: dict[str, float]) -> TrainMetrics:
    """Accumulate the gradients of one call; its metrics carry the per-token logprobs and losses."""
    return backend.forward_backward(batch, ServiceLoss(loss_fn, config))


def check_adam(params: dict[str, Any]) -> dict[str, float]:
    """AdamW parameters of an optim_step (SDK field names), or UserError."""
    unknown = sorted(set(params) - set(ADAM_KEYS) - {"type"})
    if unknown:
        raise UserError(f"adam_params.{unknown[0]}: unknown field (AxRL takes {list(ADAM_KEYS)})")
    if params.get("type") not in (None, "adamw", "adam"):
        raise UserError(f"optimizer {params.get('type')!r} is not supported by AxRL: only AdamW")
    out = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
           "grad_clip_norm": 0.0}
    for k in ADAM_KEYS:
        if k in params:
            v = params[k]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                raise UserError(f"adam_params.{k} must be a number, got {v!r}")
            out[k] = float(v)
    if out["learning_rate"] < 0 or not 0 <= out["beta1"] < 1 or not 0 <= out["beta2"] < 1:
        raise UserError("adam_params: learning_rate must be >= 0 and beta1, beta2 in [0, 1)")
    return out


def apply_optim(backend: TrainBackend, adam: dict[str, float]) -> StepStats:
    """The step's optimizer update with the call's AdamW parameters (rate: learning_rate as given;
    weight decay on matrices, as AxRL decays), on whichever backend trains the model."""
    hyper = AdamHyper((adam["beta1"], adam["beta2"]), adam["eps"], adam["weight_decay"], adam["grad_clip_norm"])
    return backend.optimizer_step(lr=adam["learning_rate"], adam=hyper)


def merged_metrics(calls: list[TrainMetrics]) -> TrainMetrics:
    """One update's metrics from its calls: summed loss, micro-batch rows in call order."""
    rows = [r for m in calls for r in m.micro_batches]
    return TrainMetrics(loss=sum(m.loss for m in calls), micro_batches=rows,
                        metrics={**reduce_microbatch_metrics(rows), "num_micro_batches": float(len(rows))})


def service_attrs(attrs: dict[str, Any]) -> tuple[list[CallSpec], dict[str, float]] | None:
    """The calls and AdamW parameters of a recorded service step (None: not a service step)."""
    if CALLS_ATTR not in attrs:
        return None
    calls = [CallSpec(c["loss_fn"], c["config"], *c["samples"]) for c in json.loads(str(attrs[CALLS_ATTR]))]
    return calls, json.loads(str(attrs[OPTIM_ATTR]))


def replay_service_step(backend: TrainBackend, batch: PackedBatch, calls: list[CallSpec],
                        adam: dict[str, float], ranks: int = 1) -> list[UpdateResult]:
    """Re-run a recorded service step on `batch` (all its samples, in call order): the update.
    `ranks` > 1: the step ran on a Ray train group of that many data-parallel ranks
    (`data_parallel_calls`)."""
    if ranks > 1:
        metrics = data_parallel_calls(backend, batch, calls, ranks)
    else:
        metrics = [run_call(backend, batch.select(list(range(c.start, c.end))), c.loss_fn, c.config) for c in calls]
    stats = apply_optim(backend, adam)
    return [UpdateResult(list(range(batch.num_samples)), merged_metrics(metrics), stats, backend.fingerprint())]


def data_parallel_calls(backend: Any, batch: PackedBatch, calls: list[CallSpec], ranks: int) -> list[TrainMetrics]:
    """The calls as a Ray train group of `ranks` data-parallel ranks ran them, in one process: each
    call's datums split into the group's contiguous shares (`shard_rows`); rank r accumulated the
    gradients of its shares over the calls, and optim_step summed the ranks' gradients. So each
    rank's gradients are computed apart, then added in rank order — for two ranks the very sum the
    group's all-reduce makes; per call, the metrics list the ranks' micro-batches in rank order."""
    params = [p for p in backend.model.parameters() if p.requires_grad]
    per_rank: list[list[TrainMetrics]] = []
    grads: list[list[torch.Tensor]] = []
    for r in range(ranks):
        shares = call_shares(batch, calls, ranks)[r::ranks]   # rank r's share of each call
        per_rank.append([run_call(backend, share, c.loss_fn, c.config) for share, c in zip(shares, calls)])
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad for p in params])
        for p in params:
            p.grad = None
    for i, p in enumerate(params):
        total = grads[0][i]
        for g in grads[1:]:
            total = total + g[i]
        p.grad = total
    return [merged_metrics([per_rank[r][i] for r in range(ranks)]) for i in range(len(calls))]


def call_shares(batch: PackedBatch, calls: list[CallSpec], ranks: int) -> list[PackedBatch]:
    """The pieces a service step's batch went through the trainer in, in batch order: one per
    call, split into the data-parallel shares of a Ray train group of `ranks` ranks."""
    from axrl.ray_executor.handles import shard_rows

    out = []
    for c in calls:
        call = batch.select(list(range(c.start, c.end)))
        out += [call] if ranks == 1 else [call.select(rows) for rows in shard_rows(call, ranks)]
    return out


def service_forward(backend: TrainBackend, batch: PackedBatch, calls: list[CallSpec], ranks: int) -> ForwardResult:
    """The no-grad forward of a service step as its calls ran it (`call_shares`): the old
    logprobs, entropy and routing the recording holds, computed piece by piece."""
    parts = [backend.forward(piece) for piece in call_shares(batch, calls, ranks)]
    routed = [p.routed_experts for p in parts]
    return ForwardResult(logprobs=torch.cat([p.logprobs for p in parts]), entropy=torch.cat([p.entropy for p in parts]),
                         routed_experts=None if any(r is None for r in routed) else torch.cat(routed))
