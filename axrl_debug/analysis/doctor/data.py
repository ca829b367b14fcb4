"""One step of a trace as the doctor's signatures read it: the token columns plus what they derive
(Δ, generated/analysed masks, positions in the sample and in the response segment, the routing
each token was *predicted* with). Only the trace: never the run's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from axrl.trace import StepFile
from axrl.trace.quantities import analysed_mask, delta

COLUMNS = ("/tokens/ids", "/tokens/loss_mask", "/tokens/rollout_logprob", "/tokens/old_logprob", "/tokens/turn",
           "/tokens/policy_version", "/samples/offsets", "/samples/sample_id")
OPTIONAL = ("/tokens/behaviour_train_logprob", "/tokens/drift", "/routing/rollout", "/routing/train",
            "/routing/rollout_valid")


@dataclass
class StepView:
    """The columns of one step and the per-token quantities every signature shares."""

    step: int
    policy_version: int
    ids: np.ndarray
    loss_mask: np.ndarray
    rollout: np.ndarray
    old: np.ndarray
    turn: np.ndarray
    version: np.ndarray
    offsets: np.ndarray
    sample_ids: np.ndarray
    behaviour: np.ndarray | None = None
    drift: np.ndarray | None = None
    routing_rollout: np.ndarray | None = None   # [T, L, k]
    routing_train: np.ndarray | None = None
    routing_valid: np.ndarray | None = None
    derived: dict[str, np.ndarray] = field(default_factory=dict)

    # -------------------------------------------------------------- derived per-token quantities
    @property
    def trained(self) -> np.ndarray:
        return self.loss_mask != 0

    @property
    def generated(self) -> np.ndarray:
        """Tokens the engine sampled: a finite rollout logprob or a policy version ≥ 0."""
        return np.isfinite(self.rollout) | (self.version >= 0)

    @property
    def analysed(self) -> np.ndarray:
        if "analysed" not in self.derived:
            self.derived["analysed"] = analysed_mask(self.loss_mask, self.rollout, self.old)
        return self.derived["analysed"]

    @property
    def delta(self) -> np.ndarray:
        """Δ = old − rollout per token (float64; NaN where either is missing)."""
        if "delta" not in self.derived:
            self.derived["delta"] = delta(self.rollout, self.old)
        return self.derived["delta"]

    @property
    def sample_row(self) -> np.ndarray:
        """Row in /samples of every token."""
        if "sample_row" not in self.derived:
            self.derived["sample_row"] = np.repeat(np.arange(len(self.offsets) - 1), np.diff(self.offsets))
        return self.derived["sample_row"]

    @property
    def abs_position(self) -> np.ndarray:
        """Index of every token in its sample's stream (its position in the KV cache)."""
        if "abs_position" not in self.derived:
            self.derived["abs_position"] = np.arange(len(self.ids)) - self.offsets[self.sample_row]
        return self.derived["abs_position"]

    @property
    def response_position(self) -> np.ndarray:
        """Index in the run of generated tokens it belongs to (0 = the first generated token of a
        turn, the one the engine's prefill computed); −1 for tokens the engine did not generate."""
        if "response_position" not in self.derived:
            gen = self.generated
            pos = np.full(len(gen), -1, np.int64)
            run = 0
            starts = np.zeros(len(gen), bool)
            starts[self.offsets[:-1][self.offsets[:-1] < len(gen)]] = True
            for t in range(len(gen)):  # steps hold ~1e4–1e5 tokens; a loop is clear and fast enough
                if not gen[t]:
                    run = 0
                    continue
                run = 0 if starts[t] or t == 0 or not gen[t - 1] else run + 1
                pos[t] = run
            self.derived["response_position"] = pos
        return self.derived["response_position"]

    @property
    def has_routing(self) -> bool:
        return self.routing_rollout is not None and self.routing_train is not None and self.routing_rollout.ndim == 3

    def predicting_flips(self) -> np.ndarray | None:
        """bool [T, L]: the position that predicted token t (row t − 1 of the same sample) was routed
        to another expert set by the engine than by the trainer in layer l; False where not comparable."""
        if not self.has_routing:
            return None
        if "flips" not in self.derived:
            ro = np.sort(self.routing_rollout.astype(np.int64), axis=-1)
            tr = np.sort(self.routing_train.astype(np.int64), axis=-1)
            row_flip = (ro != tr).any(axis=-1)                      # [T, L]
            if self.routing_valid is not None:
                row_flip &= (self.routing_valid != 0)[:, None]
            flips = np.zeros_like(row_flip)
            flips[1:] = row_flip[:-1]
            flips[self.offsets[:-1][self.offsets[:-1] < len(flips)]] = False  # first token of a sample
            self.derived["flips"] = flips
        return self.derived["flips"]

    def predicting_experts(self) -> np.ndarray | None:
        """int [T, L, k]: the trainer's experts at the position that predicted token t (−1 where none)."""
        if not self.has_routing:
            return None
        ex = np.full(self.routing_train.shape, -1, np.int64)
        ex[1:] = self.routing_train[:-1]
        ex[self.offsets[:-1][self.offsets[:-1] < len(ex)]] = -1
        return ex


def load_step(path: Path, step: int) -> StepView:
    """Read step `step`'s StepView from its step file."""
    with StepFile(path) as sf:
        cols = {name: np.asarray(sf[name]) for name in COLUMNS}
        opt = {name: (np.asarray(sf[name]) if name in sf else None) for name in OPTIONAL}
        version = int(sf.attrs.get("policy_version", step)) if hasattr(sf, "attrs") else step
    return StepView(step=step, policy_version=version, ids=cols["/tokens/ids"], loss_mask=cols["/tokens/loss_mask"],
                    rollout=cols["/tokens/rollout_logprob"].astype(np.float32),
                    old=cols["/tokens/old_logprob"].astype(np.float32), turn=cols["/tokens/turn"],
                    version=cols["/tokens/policy_version"], offsets=cols["/samples/offsets"].astype(np.int64),
                    sample_ids=cols["/samples/sample_id"], behaviour=opt["/tokens/behaviour_train_logprob"],
                    drift=opt["/tokens/drift"], routing_rollout=opt["/routing/rollout"],
                    routing_train=opt["/routing/train"], routing_valid=opt["/routing/rollout_valid"])


def step_stats(view: StepView) -> dict[str, float]:
    """mean/max/p99 |Δ|, mean Δ and the analysed token count of one step."""
    d = view.delta[view.analysed]
    if len(d) == 0:
        return {"tokens": 0, "mean_abs": float("nan"), "max_abs": float("nan"), "p99_abs": float("nan"),
                "mean": float("nan")}
    a = np.abs(d)
    return {"tokens": int(len(d)), "mean_abs": float(a.mean()), "max_abs": float(a.max()),
            "p99_abs": float(np.percentile(a, 99)), "mean": float(d.mean())}
