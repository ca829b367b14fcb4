"""A recorded step, read back as the trainer saw it: the packed batch (with the old logprobs), the
sample rows of each update, and every number the trace says the updates produced.

Floats are stored at the dtype the loop used (float32 per token), ids and masks as integers that
convert back exactly, so the rebuilt `PackedBatch` is bit-identical to the loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from axrl.algo.turn_credit import turn_rewards_from_column
from axrl.config import Config
from axrl.tinker_api.training import CallSpec, service_attrs
from axrl.runtime.recording.builders import CRITIC_ATTRS
from axrl.runtime.recording.tiers import ATTR_TRACE_LEVEL
from axrl.trace import StepFile
from axrl.train.protocol import PackedBatch

#: /tokens datasets replay cannot do without (the loss inputs).
REQUIRED = ("/samples/offsets", "/tokens/ids", "/tokens/loss_mask", "/tokens/advantage", "/tokens/old_logprob",
            "/tokens/rollout_logprob", "/train/update_samples", "/train/updates/sample_offsets",
            "/train/updates/loss", "/train/updates/grad_norm", "/train/updates/lr",
            "/train/weights_fingerprint_before", "/train/weights_fingerprint_after")
_UPDATE_SKIP = {"sample_offsets", "weights_fingerprint_after"}
_MB_SKIP = {"sample_offsets", "update"}


@dataclass
class RecordedUpdate:
    """What the trace says one optimizer update did."""

    samples: list[int]                              # /samples rows, in training order
    values: dict[str, Any]                          # /train/updates/<name>[u]: loss, grad_norm, lr, clipfrac, ...
    fingerprint_after: str | None                   # /train/updates/weights_fingerprint_after[u] if recorded
    micro_batches: list[dict[str, Any]] = field(default_factory=list)  # /train/micro_batches/<name> rows


@dataclass
class RecordedStep:
    step: int
    path: Path
    batch: PackedBatch                  # all samples of the step, old_logprobs set (as the loop had it)
    updates: list[RecordedUpdate]
    fingerprint_before: str
    fingerprint_after: str
    group_ids: np.ndarray               # int64 [N]
    rewards: np.ndarray                 # float64 [N]
    ok: np.ndarray                      # bool [N]: status == "ok"
    routing_train: np.ndarray | None    # [T, L, k] as recorded, or None
    entropy: np.ndarray | None          # float16 [T] as recorded
    wall_times: dict[str, float]
    turn: np.ndarray | None = None          # int64 [T]: /tokens/turn (turn credit)
    num_turns: np.ndarray | None = None     # int64 [N]
    turn_rewards: list[list[float]] | None = None  # per sample r_1 … r_K (/tokens/turn_reward; zeros if absent)
    teacher_logprobs: torch.Tensor | None = None   # float32 [T], on-policy distillation's (algo/distill.py)
    service: tuple[list[CallSpec], dict[str, float]] | None = None  # a Tinker-API step: its calls, AdamW params
    values: torch.Tensor | None = None             # float32 [T], /tokens/value: the critic's old values (gae)
    returns: torch.Tensor | None = None            # float32 [T], /tokens/return: the critic's targets
    critic: dict[str, Any] = field(default_factory=dict)  # the critic's root attrs (records.CRITIC_ATTRS)
    trace_level: str = "full"           # root attr trace_level (at standard the routing may be skipped)

    @property
    def splits(self) -> list[list[int]]:
        return [u.samples for u in self.updates]

    def dense(self, cfg: Config) -> bool:
        """True when the step was trained by a dense model: routing was being recorded
        (`trace.routing`) yet the file has none — unless trace.level standard skipped it. R3 is a
        no-op then."""
        return (cfg.trace.routing and self.trace_level == "full" and self.routing_train is None
                and self.batch.routed_experts is None)


def load_recorded_step(path: Path, cfg: Config) -> RecordedStep:
    """Read a step file into a `RecordedStep`. Raises `TraceError` (CorruptStepError) for a damaged
    file and `ValueError` for one that lacks what re-execution needs."""
    with StepFile(path) as sf:
        require_full(sf, path)
        missing = [name for name in REQUIRED if name not in sf]
        if missing:
            raise ValueError(f"{path}: cannot re-execute: missing {', '.join(missing)}")
        off = sf["/samples/offsets"].astype(np.int64)
        routing = sf.get("/routing/rollout")
        ref = sf.get("/tokens/ref_logprob")
        batch = PackedBatch(
            input_ids=torch.from_numpy(sf["/tokens/ids"].astype(np.int64)),
            offsets=torch.from_numpy(off),
            loss_mask=torch.from_numpy(sf["/tokens/loss_mask"].astype(np.float32)),
            advantages=torch.from_numpy(np.ascontiguousarray(sf["/tokens/advantage"], dtype=np.float32)),
            old_logprobs=torch.from_numpy(np.ascontiguousarray(sf["/tokens/old_logprob"], dtype=np.float32)),
            rollout_logprobs=torch.from_numpy(np.ascontiguousarray(sf["/tokens/rollout_logprob"], dtype=np.float32)),
            ref_logprobs=None if ref is None else torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)),
            routed_experts=None if routing is None else torch.from_numpy(routing.astype(np.int64)),
            temperature=cfg.rollout.temperature,
        )
        us = sf["/train/update_samples"].astype(np.int64)
        uoff = sf["/train/updates/sample_offsets"].astype(np.int64)
        columns = {k: sf[f"/train/updates/{k}"] for k in _group_keys(sf, "/train/updates") if k not in _UPDATE_SKIP}
        fps = sf.get("/train/updates/weights_fingerprint_after")
        mb_columns = {k: sf[f"/train/micro_batches/{k}"] for k in _group_keys(sf, "/train/micro_batches")
                      if k not in _MB_SKIP}
        mb_update = sf.get("/train/micro_batches/update")
        updates = []
        for u in range(len(uoff) - 1):
            rows = [] if mb_update is None else [i for i in range(len(mb_update)) if int(mb_update[i]) == u]
            updates.append(RecordedUpdate(
                samples=[int(i) for i in us[uoff[u]:uoff[u + 1]]],
                values={k: v[u] for k, v in columns.items()},
                fingerprint_after=None if fps is None else str(fps[u]),
                micro_batches=[{k: v[i] for k, v in mb_columns.items()} for i in rows]))
        status = sf.get("/samples/status")
        n = len(off) - 1
        return RecordedStep(
            step=sf.step, path=Path(path), batch=batch, updates=updates,
            fingerprint_before=str(sf["/train/weights_fingerprint_before"]),
            fingerprint_after=str(sf["/train/weights_fingerprint_after"]),
            group_ids=sf["/samples/group_id"].astype(np.int64),
            rewards=sf["/samples/reward"].astype(np.float64),
            ok=np.ones(n, bool) if status is None else np.asarray([s == "ok" for s in status]),
            routing_train=sf.get("/routing/train"), entropy=sf.get("/tokens/entropy"),
            wall_times=sf.wall_times, teacher_logprobs=_optional_tokens(sf, "/tokens/teacher_logprob"),
            service=service_attrs(sf.attrs),
            values=_optional_tokens(sf, "/tokens/value"), returns=_optional_tokens(sf, "/tokens/return"),
            critic={k: sf.attrs[k] for k in CRITIC_ATTRS if k in sf.attrs},
            trace_level=str(sf.attrs.get(ATTR_TRACE_LEVEL, "full")),
            **_turns(sf, off))


def require_full(sf: StepFile, path: Path) -> None:
    """Raise a clear ValueError when the step was written at `trace.level: summary` (no token
    columns to re-execute), naming the run's steps that have them. A `standard` step is whole but
    for its routing on some steps: it re-executes like a step recorded with trace.routing off."""
    level = str(sf.attrs.get(ATTR_TRACE_LEVEL, "full"))
    if level != "summary":
        return
    full = []
    for other in sorted(Path(path).parent.glob("step_*.h5")):
        with StepFile(other) as of:
            if str(of.attrs.get(ATTR_TRACE_LEVEL, "full")) != "summary":
                full.append(int(of.attrs["step"]))
    raise ValueError(f"step {sf.attrs['step']} was recorded at trace.level summary: no per-token columns, it "
                     f"cannot be replayed (steps with token columns: {', '.join(map(str, full)) or 'none'}; "
                     f"trace.keep_full keeps the steps before a spike full)")


def _optional_tokens(sf: StepFile, name: str) -> torch.Tensor | None:
    """float32 [T] of a per-token column the step file may lack."""
    values = sf.get(name)
    return None if values is None else torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _turns(sf: StepFile, off: np.ndarray) -> dict[str, Any]:
    """turn, num_turns and the per-turn rewards (axrl.algo.turn_credit) of a step file."""
    turn = sf["/tokens/turn"].astype(np.int64)
    num_turns = sf["/samples/num_turns"].astype(np.int64)
    column = sf.get("/tokens/turn_reward")
    column = np.zeros(len(turn)) if column is None else np.asarray(column, np.float64)
    rewards = [turn_rewards_from_column(column[a:b], turn[a:b], int(k))
               for a, b, k in zip(off[:-1], off[1:], num_turns)]
    return {"turn": turn, "num_turns": num_turns, "turn_rewards": rewards}


def _group_keys(sf: StepFile, group: str) -> list[str]:
    prefix = group + "/"
    return [k[len(prefix):] for k in sf.keys() if k.startswith(prefix) and "/" not in k[len(prefix):]]

