"""Checking an `r3` argument (rollout routing replay) against the model and the batch before a
forward replays `PackedBatch.routed_experts`; shared by both train backends."""

from __future__ import annotations

from axrl.model import ModelConfig
from axrl.train.protocol import R3, PackedBatch, R3Scope, r3_scope


def use_r3(cfg: ModelConfig, batch: PackedBatch, r3: R3) -> R3Scope | None:
    """The R3 scope a forward replays `batch.routed_experts` under (None: no replay): r3 on an MoE
    model, with routing of the right shape and range and scope layers that exist (else ValueError)."""
    scope = r3_scope(r3)
    if scope is None or not cfg.is_moe:
        return None  # a dense model has no routing to replay
    re = batch.routed_experts
    if re is None:
        raise ValueError("r3=True but PackedBatch.routed_experts is None")
    want = cfg.routing_shape()[:2]
    if re.ndim != 3 or tuple(re.shape[1:]) != want:
        raise ValueError(f"PackedBatch.routed_experts has shape {tuple(re.shape)}, expected [T, {want[0]}, {want[1]}]")
    if re.numel() and (int(re.min()) < 0 or int(re.max()) >= cfg.num_experts):
        raise ValueError(f"PackedBatch.routed_experts holds expert ids outside [0, {cfg.num_experts})")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    bad = [i for i in (scope.layers or ()) + scope.exclude_layers if i not in moe]
    if bad:
        raise ValueError(f"R3 scope layers {bad} are not MoE layers of the model (MoE layers: {moe})")
    return scope
