"""What-if variants: re-run step N from the same starting state under a changed config.

A variant is a list of `key=value` assignments (values parsed as YAML, as `axrl train --set`):

* config keys that shape the training part of a step: `algo.*` (the objective `algo.loss` and its
  `loss_args`, the corrections `algo.correction.*`, clip range, TIS and its cap, dual clip, KL,
  entropy, loss aggregation, and the reward-to-advantage pipeline — `algo.advantage`,
  `normalize_std`, `advantage_clip`, `advantage_balance`, `overlong_penalty` — which recomputes
  the advantages from the recorded rewards), `train.*` (lr, grad clip, micro-batch size, updates
  per step, ...), `r3` and `r3_scope.*`, `rollout.temperature`, `distill.coef` / `distill.mode` (the
  distillation advantage recomputed from the recorded teacher logprobs), `runtime.*`, `faults.lr_scale*`;
* replay-only knobs: `replay.dtype=bfloat16|float32` (the trainer's compute dtype, bf16 autocast
  with fp32 master weights) and `replay.drop_top_k=K` (drop from the loss the K loss tokens with
  the largest train/inference ratio exp(old_logprob − rollout_logprob), the weight TIS truncates).

Keys that act before the training part (data, rollout sampling, dynamic sampling, model, seed, ...)
cannot be varied: the replay feeds recorded rollouts. When a variant changes how the trainer's
forward runs (r3, dtype, temperature, threads, micro-batch size) the old logprobs are recomputed
under the variant, as the loop's prepare phase would have; otherwise the recorded ones are used.
A variant with `algo.kl_coef > 0` on a step without recorded reference logprobs computes them
under the run's reference policy (checkpoint `step_000000`). Each variant reports, per update,
what the loss did (its own metrics, from the objective in the registry) and `update_norm`, the
size ‖Δθ‖ of the update.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from axrl.algo import segment_sum, token_advantages
from axrl.algo.distill import distill_token_advantages
from axrl.algo.turn_credit import turn_credit_advantages
from axrl.algo.processor import gae_advantages, gae_token_rewards, update_splits
from axrl.config import Config, ConfigError, apply_overrides, load_config
from axrl.assembly.build import make_train_backend, policy_loss
from axrl.assembly.settings import advantage_settings, routing_replay, step_settings
from axrl.runtime.results import UpdateResult
from axrl.runtime.reference import restore_reference, with_reference_logprobs
from axrl.runtime.updates import run_updates
from axrl.tokenizer import Tokenizer
from axrl.train.protocol import PackedBatch, TrainBackend
from replay.plan import ReplayInputError
from replay.recorded import RecordedStep

VARIABLE_PREFIXES = ("algo.", "train.", "runtime.", "faults.lr_scale", "replay.", "r3_scope")
VARIABLE_KEYS = ("r3", "rollout.temperature", "distill.coef", "distill.mode")
#: algo keys that act on the rollout side (refused like data.*).
ROLLOUT_SIDE_PREFIXES = ("algo.dynamic_sampling",)
#: config paths whose change alters the trainer forward (so the old logprobs are recomputed).
FORWARD_PATHS = (("r3",), ("r3_scope",), ("rollout", "temperature"), ("runtime", "threads"),
                 ("runtime", "deterministic"), ("train", "micro_batch_tokens"))
#: metrics shown per update, baseline vs variant (keys of the backend's aggregated metrics, plus
#: `update_norm` measured by the replay).
SUMMARY_KEYS = ("loss", "grad_norm", "update_norm", "lr", "clipfrac", "ratio_mean", "ratio_min", "ratio_max",
                "approx_kl", "is_weight_mean", "tis_weight_mean", "tis_capped_frac", "kl", "entropy",
                "num_loss_tokens")


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
    if any(key.startswith(p) for p in ROLLOUT_SIDE_PREFIXES):
        return False
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
        if key == "train.lora" or key.startswith("train.lora."):
            raise ReplayInputError(f"--set {key}: cannot be varied in a replay: the run's checkpoints hold its "
                                   "trained weights as they are (base + LoRA adapters, or full)", None)
        if not _allowed(key):
            raise ReplayInputError(
                f"--set {key}: cannot be varied in a replay (it acts before the training part of the step, "
                f"whose rollouts are recorded); variable: algo.* (not algo.dynamic_sampling), train.*, r3, "
                f"r3_scope.*, rollout.temperature, distill.coef, distill.mode, runtime.*, faults.lr_scale, replay.dtype, "
                f"replay.drop_top_k", None)
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


class UpdateSizes:
    """`UpdateHooks` that measure each update's size ‖θ_after − θ_before‖ (over every weight
    tensor, in float64). Only reads the weights."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend = backend
        self.sizes: list[float] = []
        self._before: dict[str, torch.Tensor] = {}

    def before_update(self, index: int, batch: PackedBatch) -> None:
        self._before = {n: t.detach().clone() for n, t in self.backend.named_weights()}

    def before_optimizer_step(self, index: int) -> None:
        pass

    def after_update(self, index: int, result: UpdateResult) -> None:
        sq = sum(float((t.detach().double() - self._before[n].double()).pow(2).sum())
                 for n, t in self.backend.named_weights())
        self.sizes.append(math.sqrt(sq))
        self._before = {}


def summarize(results: Sequence[UpdateResult], sizes: Sequence[float] = ()) -> list[dict[str, float]]:
    """Per update: loss, grad norm, update size, lr, clip fraction, ratio and correction statistics."""
    rows = []
    for i, r in enumerate(results):
        m = {"loss": r.metrics.loss, "grad_norm": r.stats.grad_norm, "lr": r.stats.lr, **r.metrics.metrics}
        if i < len(sizes):
            m["update_norm"] = sizes[i]
        rows.append({k: float(m[k]) for k in SUMMARY_KEYS if k in m})
    return rows


def recompute_advantages(rec: RecordedStep, cfg: Config) -> torch.Tensor:
    """Token advantages from the recorded rewards, by the pipeline `AlgorithmProcessor` runs
    (under `algo.credit: turn`, from the recorded per-turn rewards too), then, with `distill`, the
    distillation term from the recorded teacher logprobs, as the step trainer adds it."""
    settings = advantage_settings(cfg)
    if settings.estimator == "gae":  # from the recorded rewards and the critic's recorded values
        if rec.values is None:
            raise ReplayInputError(f"{rec.path}: algo.advantage: gae needs the step's /tokens/value (the critic's "
                                   "values), which it lacks: the run was trained without a critic")
        assert rec.turn is not None and rec.turn_rewards is not None and rec.num_turns is not None
        rewards = gae_token_rewards(settings, rec.rewards, rec.batch.offsets, rec.batch.loss_mask, rec.turn,
                                    rec.turn_rewards, rec.num_turns.tolist())
        tokens = gae_advantages(settings, rewards, rec.values, rec.batch.offsets, rec.batch.loss_mask, rec.turn)[0]
    elif settings.credit == "turn":
        tokens = turn_credit_advantages(settings, rec.rewards, rec.turn_rewards, rec.num_turns, rec.group_ids,
                                        rec.ok, rec.batch.offsets, rec.batch.loss_mask, rec.turn)[1]
    else:
        loss_tokens = segment_sum(rec.batch.loss_mask.double(), rec.batch.offsets).numpy()
        adv = settings.sample_advantages(rec.rewards, rec.group_ids, rec.ok, loss_tokens)
        tokens = token_advantages(adv, rec.batch.offsets, rec.batch.loss_mask)
    d = cfg.distill
    if d is None:
        return tokens
    if rec.teacher_logprobs is None or rec.batch.rollout_logprobs is None:
        raise ReplayInputError(f"{rec.path}: `distill` needs the step's /tokens/teacher_logprob, which it lacks")
    return distill_token_advantages(tokens, rec.teacher_logprobs, rec.batch.rollout_logprobs, rec.batch.loss_mask,
                                    d.coef, d.mode)


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
                tokenizer: Tokenizer, run_dir: Path) -> VariantResult:
    """Re-run step `rec.step` under the variant from `state` (the backend state before the step)."""
    try:
        backend = make_train_backend(variant.cfg, tokenizer, compute_dtype=variant.knobs.dtype)
    except (NotImplementedError, ValueError) as e:
        raise ReplayInputError(f"what-if {variant.label}: cannot build its trainer: {e}") from None
    try:
        return _run_on(backend, variant, base_cfg, rec, state, run_dir)
    finally:
        backend.close()


def _run_on(backend: TrainBackend, variant: Variant, base_cfg: Config, rec: RecordedStep,
            state: dict[str, Any], run_dir: Path) -> VariantResult:
    cfg, knobs, notes = variant.cfg, variant.knobs, []
    needs_ref = cfg.algo.kl_coef > 0 and rec.batch.ref_logprobs is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "checkpoint config differs": that is the point of a variant
        if needs_ref:
            try:
                restore_reference(backend, run_dir, True)
            except FileNotFoundError as e:
                raise ReplayInputError(f"what-if {variant.label}: {e}") from None
        backend.load_state_dict(state)
    batch = dataclasses.replace(rec.batch, temperature=cfg.rollout.temperature)
    if (advantage_settings(cfg) != advantage_settings(base_cfg)
            or cfg.distill != base_cfg.distill):
        batch = dataclasses.replace(batch, advantages=recompute_advantages(rec, cfg))
        distill = cfg.distill
        how = advantage_settings(cfg).describe() + ("" if distill is None else f"; {distill.describe()}")
        notes.append(f"advantages recomputed from the recorded rewards ({how})")
    forward_changed = (knobs.dtype not in (None, "float32")
                       or any(_get(cfg, p) != _get(base_cfg, p) for p in FORWARD_PATHS))
    if forward_changed:
        old = backend.forward(dataclasses.replace(batch, old_logprobs=None), r3=routing_replay(cfg))
        batch = dataclasses.replace(batch, old_logprobs=old.logprobs)
        notes.append("old logprobs recomputed under the variant: its trainer forward differs")
    if needs_ref:
        batch = with_reference_logprobs(backend, batch, cfg.algo.kl_coef > 0, routing_replay(cfg))
        notes.append("reference logprobs computed under the run's reference policy (checkpoint step_000000)")
    batch, dropped = drop_top_ratio(batch, knobs.drop_top_k)
    if dropped:
        shown = ", ".join(f"token {d['token']} (ratio {d['ratio']:.3g})" for d in dropped[:5])
        notes.append(f"dropped {len(dropped)} loss token(s) with the largest exp(old − rollout): {shown}"
                     + (" …" if len(dropped) > 5 else ""))
    splits = rec.splits
    if cfg.train.updates_per_step != base_cfg.train.updates_per_step:
        splits = update_splits(rec.group_ids, cfg.train.updates_per_step)
        notes.append(f"{len(splits)} update(s) instead of {len(rec.splits)}")
    if cfg.r3 and batch.routed_experts is None and not rec.dense(base_cfg):
        raise ReplayInputError(f"what-if r3=true: step {rec.step} has no /routing/rollout (trace.routing was off?)")
    sizes = UpdateSizes(backend)
    try:
        results = run_updates(backend, batch, splits, policy_loss(cfg), r3=routing_replay(cfg),
                              lr_scale=step_settings(cfg).lr_scale_at(rec.step), hooks=sizes)
    except ValueError as e:  # e.g. an R3 scope naming layers the model does not have
        raise ReplayInputError(f"what-if {variant.label}: {e}") from None
    return VariantResult(label=variant.label, assignments=variant.assignments, updates=summarize(results, sizes.sizes),
                         notes=notes, fingerprint_after=results[-1].fingerprint)
