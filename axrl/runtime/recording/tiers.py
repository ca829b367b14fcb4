"""Recording tiers (`trace.level`, `trace.routing_every`, `trace.keep_full`): what of a step goes
to disk, and the in-memory ring of full records promoted when the spike trigger fires.

`full` writes the learner's record as it is (no attribute added: the files are those of a run
without tiers). The reduced levels write a filtered copy of it, marked in the root attr
`trace_level`:
- `standard`: every column, but the routing datasets only on steps divisible by `routing_every`;
- `summary`: the samples, updates and micro-batches with empty token columns (every sample has
  0 tokens in /samples/offsets, so /samples/prompt_len is 0 too) plus per-sample and per-turn statistics in /samples
  (`SUMMARY_SAMPLE_COLUMNS`), so the step table, rewards and losses stay readable.

A spike needs the steps before it at full resolution: `TieredRecords` keeps the last
`keep_full` full records in memory and, on a spike, hands them (attr `trace_promoted_by`: the
spike step) and the spike step itself to the writer in full, replacing their reduced files.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from axrl.trace import schema as S
from axrl.trace.step_record import StepRecord

__all__ = ["ATTR_TRACE_LEVEL", "ATTR_PROMOTED_BY", "LEVELS", "SUMMARY_SAMPLE_COLUMNS", "TierSettings",
           "TieredRecords", "reduce_record", "writes_routing"]

LEVELS = ("full", "standard", "summary")
ATTR_TRACE_LEVEL = "trace_level"          # root attr of a step written by trace.level standard/summary
ATTR_PROMOTED_BY = "trace_promoted_by"    # root attr: the spike step that promoted this full step
SUMMARY_SAMPLE_COLUMNS = {
    "tokens": "tokens of the sample", "generated_tokens": "its loss-mask tokens",
    "prompt_tokens": "its initial prompt's tokens (/samples/prompt_len is 0: the step holds no tokens)",
    "rollout_logprob_mean": "mean engine logprob over its loss tokens",
    "old_logprob_mean": "mean trainer logprob over its loss tokens",
    "mismatch_mean": "mean |old - rollout logprob| over its loss tokens",
    "mismatch_max": "max |old - rollout logprob| over its loss tokens",
    "entropy_mean": "mean trainer entropy over its loss tokens",
    "turn_generated_tokens": "[N, turns] loss tokens per turn (turn = /tokens/turn)",
    "turn_mismatch_mean": "[N, turns] mean |old - rollout logprob| per turn (NaN: none)",
}
_ROUTING_FIELDS = ("routing_rollout", "routing_rollout_valid", "routing_train", "pool_routing_rollout")


class TierSettings(BaseModel):
    """`trace.level`, `trace.routing_every`, `trace.keep_full` (module docstring); the config's
    `trace` section extends this type, so these keys have one set of defaults and rules."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: Literal["full", "standard", "summary"] = Field(
        "full", description="full: every column every step; standard: token columns every step, routing only "
                            "every routing_every steps; summary: per-sample and per-turn statistics only (no "
                            "per-token columns; replay needs full steps)")
    routing_every: int = Field(1, ge=1, description="level standard: routing written on steps divisible by this")
    keep_full: int = Field(0, ge=0, description="level standard/summary: hold the last K steps at full resolution "
                                                "in memory; when the spike trigger fires they and the spike step "
                                                "are written in full (0 = off; the spike step is always full)")

    def __init__(self, level: str = "full", routing_every: int = 1, keep_full: int = 0, **more: Any) -> None:
        # positional `level` as before (`TierSettings("standard", routing_every=2)`); `more`: a subclass' keys
        super().__init__(level=level, routing_every=routing_every, keep_full=keep_full, **more)

    @model_validator(mode="after")
    def _tiers(self) -> "TierSettings":
        if self.routing_every != 1 and self.level != "standard":
            raise ValueError(f"routing_every: applies to level standard only (level is {self.level})")
        if self.keep_full and self.level == "full":
            raise ValueError("keep_full: at level full every step is already written in full; set level "
                             "standard or summary, or keep_full: 0")
        return self

    def tier_settings(self) -> "TierSettings":
        """This object's `TierSettings` fields alone (a `trace` section's other keys left out)."""
        return TierSettings(self.level, self.routing_every, self.keep_full)


def writes_routing(record: StepRecord, tiers: TierSettings) -> bool:
    """Whether `record` — as handed to the writer: the learner's full record, a reduced one, or a
    promoted one (marked full) — is written with its routing."""
    if record.num_experts is None:
        return False
    level = record.attrs.get(ATTR_TRACE_LEVEL, tiers.level)
    return level == "full" or (level == "standard" and record.step % tiers.routing_every == 0)


def reduce_record(record: StepRecord, tiers: TierSettings) -> StepRecord:
    """The copy of `record` that `tiers` writes for its step (`record` itself at level full)."""
    if tiers.level == "full":
        return record
    attrs = {**record.attrs, ATTR_TRACE_LEVEL: tiers.level}
    if tiers.level == "summary":
        return _summary(record, attrs)
    if writes_routing(record, tiers):
        return dataclasses.replace(record, attrs=attrs)
    return dataclasses.replace(record, attrs=attrs, **{f: None for f in _ROUTING_FIELDS})


def _summary(record: StepRecord, attrs: dict[str, Any]) -> StepRecord:
    """No per-token column (required ones empty, so every sample has 0 tokens); statistics instead."""
    empty: dict[str, Any] = {}
    for spec in S.DATASETS:
        if spec.shape[:1] in (("T",), ("DT",)):
            empty[spec.field] = (np.zeros(0, spec.np_dtype) if spec.required else None)
    n = record.num_samples
    empty["sample_offsets"], empty["prompt_len"] = np.zeros(n + 1, np.int64), np.zeros(n, np.int32)
    if record.pool_sample_offsets is not None:
        empty["pool_sample_offsets"] = np.zeros(len(np.asarray(record.pool_sample_offsets)), np.int64)
        empty.update(pool_token_ids=np.zeros(0, np.int32), pool_turn=np.zeros(0, np.int16),
                     pool_token_policy_version=np.zeros(0, np.int32), pool_rollout_logprob=np.zeros(0, np.float32))
    return dataclasses.replace(record, attrs=attrs, num_experts=None, extra_tokens={},
                               extra_samples={**record.extra_samples, **summary_columns(record)}, **empty)


def _segment_mean(seg: np.ndarray, values: np.ndarray, keep: np.ndarray, size: int) -> np.ndarray:
    count = np.bincount(seg[keep], minlength=size)
    total = np.bincount(seg[keep], weights=values[keep], minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def summary_columns(record: StepRecord) -> dict[str, np.ndarray]:
    """Per-sample [N] and per-turn [N, turns] statistics of `record`'s token columns
    (`SUMMARY_SAMPLE_COLUMNS`); means over loss-mask tokens with finite values."""
    off = np.asarray(record.sample_offsets, np.int64)
    n = len(off) - 1
    seg = np.repeat(np.arange(n), np.diff(off))
    loss = np.asarray(record.loss_mask) != 0
    rollout = np.asarray(record.rollout_logprob, np.float64)
    old = np.asarray(record.old_logprob, np.float64)
    gap = np.abs(old - rollout)
    both = loss & np.isfinite(gap)
    turn = np.asarray(record.turn, np.int64)
    turns = int(turn.max()) + 1 if turn.size else 1
    cell = seg * turns + turn
    gap_max = np.full(n, np.nan)
    if both.any():
        np.fmax.at(gap_max, seg[both], gap[both])
    return {
        "tokens": np.diff(off),
        "generated_tokens": np.bincount(seg[loss], minlength=n).astype(np.int64),
        "prompt_tokens": np.asarray(record.prompt_len, np.int64),
        "rollout_logprob_mean": _segment_mean(seg, rollout, loss & np.isfinite(rollout), n),
        "old_logprob_mean": _segment_mean(seg, old, loss & np.isfinite(old), n),
        "mismatch_mean": _segment_mean(seg, gap, both, n),
        "mismatch_max": gap_max,
        "entropy_mean": _segment_mean(seg, np.asarray(record.entropy, np.float64), loss, n),
        "turn_generated_tokens": np.bincount(cell[loss], minlength=n * turns).astype(np.int64).reshape(n, turns),
        "turn_mismatch_mean": _segment_mean(cell, gap, both, n * turns).reshape(n, turns),
    }


class TieredRecords:
    """Turns each step's full record into the records to write (`for_step`), keeping the ring of
    the last `keep_full` full records for a spike (levels other than full)."""

    def __init__(self, tiers: TierSettings) -> None:
        self.tiers = tiers
        self.ring: collections.deque[StepRecord] = collections.deque(maxlen=max(tiers.keep_full, 1))

    def for_step(self, record: StepRecord, spiked: bool) -> list[StepRecord]:
        """The records to write, in step order: the step's reduced record, or on a spike the
        buffered full steps (promoted) and the step itself in full."""
        if self.tiers.level == "full":
            return [record]
        if spiked:
            promoted = [_mark_full(r, record.step) for r in self.ring]
            self.ring.clear()
            return promoted + [_mark_full(record, None)]
        if self.tiers.keep_full:
            self.ring.append(record)
        return [reduce_record(record, self.tiers)]


def _mark_full(record: StepRecord, promoted_by: int | None) -> StepRecord:
    attrs: dict[str, Any] = {**record.attrs, ATTR_TRACE_LEVEL: "full"}
    if promoted_by is not None:
        attrs[ATTR_PROMOTED_BY] = promoted_by
    return dataclasses.replace(record, attrs=attrs)
