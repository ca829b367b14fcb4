"""What-if variants: re-run step N from the same starting state under a changed config.

A variant is a list of `key=value` assignments (values parsed as YAML, as `axrl train --set`):

* config keys that shape the training part of a step: `algo.*` (clip range, TIS and its cap,
  dual clip, KL, entropy, loss aggregation, and `algo.advantage` / `algo.normalize_std`, which
  recompute the advantages from the recorded rewards), `train.*` (lr, grad clip, micro-batch
  size, updates per step, ...), `r3`, `rollout.temperature`, `runtime.*`, `faults.lr_scale*`;
* replay-only knobs: `replay.dtype=bfloat16|float32` (the trainer's compute dtype, bf16 autocast
  with fp32 master weights) and `replay.drop_top_k=K` (drop from the loss the K loss tokens with
  the largest train/inference ratio exp(old_logprob − rollout_logprob), the weight TIS truncates).

Keys that act before the training part (data, rollout sampling, model, seed, ...) cannot be
varied: the replay feeds recorded rollouts. When a variant changes how the trainer's forward
runs (r3, dtype, temperature, threads, micro-batch size) the old logprobs are recomputed under
the variant, as the loop's prepare phase would have; otherwise the recorded ones are used.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from axrl.algo import compute_advantages, token_advantages
from axrl.config import Config, ConfigError, apply_overrides, load_config
from axrl.runtime.faults import lr_scale
from axrl.runtime.components import make_train_backend
from axrl.runtime.records import UpdateResult
from axrl.runtime.updates import policy_loss, run_updates
from axrl.tokenizer import Tokenizer
from axrl.train.protocol import PackedBatch, TrainBackend
from replay.plan import ReplayInputError
from replay.recorded import RecordedStep

VARIABLE_PREFIXES = ("algo.", "train.", "runtime.", "faults.lr_scale", "replay.")
VARIABLE_KEYS = ("r3", "rollout.temperature")
#: config paths whose change alters the trainer forward (so the old logprobs are recomputed).
FORWARD_PATHS = (("r3",), ("rollout", "temperature"), ("runtime", "threads"), ("runtime", "deterministic"),
                 ("train", "micro_batch_tokens"))
#: metrics shown per update, baseline vs variant (keys of the backend's aggregated metrics).
SUMMARY_KEYS = ("loss", "grad_norm", "lr", "clipfrac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl",
                "tis_weight_mean", "tis_capped_frac", "entropy", "num_loss_tokens")


class ReplayKnobs(BaseModel):
    """The `replay.*` keys of a variant."""

    model_config = ConfigDict(extra="forbid")
    dtype: Literal["float32", "bfloat16"] | None = None
    drop_top_k: int = Field(0, ge=0)


@dataclass
class Variant:
    label: str
    assignments: list[str]
    cfg: Config
    knobs: ReplayKnobs


@dataclass
class VariantResult:
    label: str
    assignments: list[str]
    updates: list[dict[str, float]]
    notes: list[str] = field(default_factory=list)
    fingerprint_after: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "set": self.assignments, "updates": self.updates, "notes": self.notes,
                "fingerprint_after": self.fingerprint_after}


def _allowed(key: str) -> bool:
    return key in VARIABLE_KEYS or any(key.startswith(p) for p in VARIABLE_PREFIXES)


def parse_variant(config_path: Path, assignments: Sequence[str]) -> Variant:
    """Validate a variant against the run's config.yaml; ReplayInputError (exit 2) on bad input."""
    config_keys, replay_keys = [], []
    for item in assignments:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise ReplayInputError(f"--set {item!r}: expected key=value, e.g. --set algo.tis=false")
        if key == "train.dtype":
            raise ReplayInputError("--set train.dtype: not a config key; use replay.dtype=bfloat16|float32 "
                                   "(the trainer's compute dtype)", None)
        if not _allowed(key):
            raise ReplayInputError(
                f"--set {key}: cannot be varied in a replay (it acts before the training part of the step, "
                f"whose rollouts are recorded); variable: algo.*, train.*, r3, rollout.temperature, runtime.*, "
                f"faults.lr_scale, replay.dtype, replay.drop_top_k", None)
        (replay_keys if key.startswith("replay.") else config_keys).append(item)
    try:
        cfg = load_config(config_path, config_keys)
        knobs = ReplayKnobs.model_validate(apply_overrides({}, replay_keys).get("replay", {}))
    except ConfigError as e:
        raise ReplayInputError(f"what-if {' '.join(assignments)}: {e}") from None
    except ValidationError as e:
        msgs = "; ".join(f"replay.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ReplayInputError(f"what-if {' '.join(assignments)}: {msgs}") from None
    return Variant(label=" ".join(assignments), assignments=list(assignments), cfg=cfg, knobs=knobs)


def summarize(results: Sequence[UpdateResult]) -> list[dict[str, float]]:
    """Per update: loss, grad norm, lr, clip fraction, PPO ratio and TIS statistics."""
    rows = []
    for r in results:
        m = {"loss": r.metrics.loss, "grad_norm": r.stats.grad_norm, "lr": r.stats.lr, **r.metrics.metrics}
        rows.append({k: float(m[k]) for k in SUMMARY_KEYS if k in m})
    return rows


def split_updates(group_ids: np.ndarray, updates: int) -> list[list[int]]:
    """Sample rows of each update: `updates` contiguous, near-equal chunks of whole groups —
    the rule of `ProcessedBatch.update_splits`, over recorded group ids."""
    groups: list[list[int]] = []
    for i, g in enumerate(group_ids.tolist()):
        if groups and group_ids[groups[-1][0]] == g:
            groups[-1].append(i)
        else:
            groups.append([i])
    chunks = np.array_split(np.arange(len(groups)), min(updates, len(groups)))
    return [[i for g in chunk for i in groups[g]] for chunk in chunks if len(chunk)]


def recompute_advantages(rec: RecordedStep, cfg: Config) -> torch.Tensor:
    """Token advantages from the recorded rewards, as `AlgorithmProcessor` computes them."""
    estimator = cfg.algo.advantage
    if estimator == "grpo" and not cfg.algo.normalize_std:
        estimator = "dr_grpo"
    ok = torch.from_numpy(rec.ok)
    rewards = torch.from_numpy(rec.rewards).float()
    groups = torch.from_numpy(rec.group_ids)
    adv = torch.zeros(len(rewards), dtype=torch.float32)
    if bool(ok.any()):
        adv[ok] = compute_advantages(rewards[ok], groups[ok], estimator=estimator).float()
    return token_advantages(adv, rec.batch.offsets, rec.batch.loss_mask)


def drop_top_ratio(batch: PackedBatch, k: int) -> tuple[PackedBatch, list[dict[str, float]]]:
    """Zero the loss mask of the k loss tokens with the largest exp(old − rollout logprob)."""
    if k <= 0 or batch.rollout_logprobs is None or batch.old_logprobs is None:
        return batch, []
    log_ratio = (batch.old_logprobs - batch.rollout_logprobs).double()
    ok = (batch.loss_mask > 0) & torch.isfinite(log_ratio)
    log_ratio = torch.where(ok, log_ratio, torch.full_like(log_ratio, -math.inf))
    k = min(k, int(ok.sum()))
    top = torch.topk(log_ratio, k).indices if k else torch.zeros(0, dtype=torch.int64)
    mask = batch.loss_mask.clone()
    mask[top] = 0.0
    dropped = [{"token": int(t), "ratio": float(math.exp(float(log_ratio[t])))} for t in top]
    return dataclasses.replace(batch, loss_mask=mask), dropped


def _get(cfg: Config, path: tuple[str, ...]) -> Any:
    node: Any = cfg
    for p in path:
        node = getattr(node, p)
    return node


def run_variant(variant: Variant, base_cfg: Config, rec: RecordedStep, state: dict[str, Any],
                tokenizer: Tokenizer) -> VariantResult:
    """Re-run step `rec.step` under the variant from `state` (the backend state before the step)."""
    try:
        backend = make_train_backend(variant.cfg, tokenizer, compute_dtype=variant.knobs.dtype)
    except (NotImplementedError, ValueError) as e:
        raise ReplayInputError(f"what-if {variant.label}: cannot build its trainer: {e}") from None
    try:
        return _run_on(backend, variant, base_cfg, rec, state)
    finally:
        backend.close()


def _run_on(backend: TrainBackend, variant: Variant, base_cfg: Config, rec: RecordedStep,
            state: dict[str, Any]) -> VariantResult:
    cfg, knobs, notes = variant.cfg, variant.knobs, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "checkpoint config differs": that is the point of a variant
        backend.load_state_dict(state)
    batch = dataclasses.replace(rec.batch, temperature=cfg.rollout.temperature)
    if (cfg.algo.advantage, cfg.algo.normalize_std) != (base_cfg.algo.advantage, base_cfg.algo.normalize_std):
        batch = dataclasses.replace(batch, advantages=recompute_advantages(rec, cfg))
        notes.append(f"advantages recomputed from the recorded rewards ({cfg.algo.advantage}, "
                     f"normalize_std={cfg.algo.normalize_std})")
    forward_changed = (knobs.dtype not in (None, "float32")
                       or any(_get(cfg, p) != _get(base_cfg, p) for p in FORWARD_PATHS))
    if forward_changed:
        old = backend.forward(dataclasses.replace(batch, old_logprobs=None), r3=cfg.r3)
        batch = dataclasses.replace(batch, old_logprobs=old.logprobs)
        notes.append("old logprobs recomputed under the variant: its trainer forward differs")
    batch, dropped = drop_top_ratio(batch, knobs.drop_top_k)
    if dropped:
        shown = ", ".join(f"token {d['token']} (ratio {d['ratio']:.3g})" for d in dropped[:5])
        notes.append(f"dropped {len(dropped)} loss token(s) with the largest exp(old − rollout): {shown}"
                     + (" …" if len(dropped) > 5 else ""))
    splits = rec.splits
    if cfg.train.updates_per_step != base_cfg.train.updates_per_step:
        splits = split_updates(rec.group_ids, cfg.train.updates_per_step)
        notes.append(f"{len(splits)} update(s) instead of {len(rec.splits)}")
    if cfg.r3 and batch.routed_experts is None and not rec.dense(base_cfg):
        raise ReplayInputError(f"what-if r3=true: step {rec.step} has no /routing/rollout (trace.routing was off?)")
    results = run_updates(backend, batch, splits, policy_loss(cfg), r3=cfg.r3, lr_scale=lr_scale(cfg, rec.step))
    return VariantResult(label=variant.label, assignments=variant.assignments, updates=summarize(results),
                         notes=notes, fingerprint_after=results[-1].fingerprint)
