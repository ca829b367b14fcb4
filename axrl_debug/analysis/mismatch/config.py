"""What the mismatch analysis reads and how it buckets: dataset paths, breakdown edges and labels,
and ``MismatchConfig`` (the run's thresholds plus analysis options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from axrl.trace.chunks import DEFAULT_CHUNK_TOKENS

# Datasets each part of the analysis reads (the reader reads nothing else).
CORE_COLUMNS = ("/samples/offsets", "/tokens/loss_mask", "/tokens/rollout_logprob", "/tokens/old_logprob")
BREAKDOWN_COLUMNS = ("/tokens/turn", "/tokens/policy_version", "/tokens/entropy")
ROUTING_COLUMNS = ("/routing/rollout", "/routing/train", "/routing/rollout_valid")
# Optional: the trainer's logprob under the generating weights, which splits Δ (``split``).
SPLIT_COLUMN = "/tokens/behaviour_train_logprob"
# ``against="teacher"``: the distillation teacher's logprob takes the trainer's place (Δ = teacher −
# rollout, so k1/k3 estimate the student–teacher reverse KL, KL(rollout ‖ teacher)).
TEACHER_COLUMN = "/tokens/teacher_logprob"
TRAINER_COLUMN = "/tokens/old_logprob"

POSITION_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99)           # last bucket is [0.99, 1]
ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0)  # last bucket is >= 8


def _range_labels(edges: tuple[float, ...], last: str) -> list[str]:
    labels = [f"[{_g(a)}, {_g(b)})" for a, b in zip(edges[:-1], edges[1:])]
    return labels + [last]


def _g(x: float) -> str:
    return f"{x:g}"


def _position_labels() -> list[str]:
    labels = ["0 (first)"]
    for a, b in zip(POSITION_EDGES[1:-1], POSITION_EDGES[2:]):
        labels.append(str(a) if b - a == 1 else f"{a}-{b - 1}")
    return labels + [f"{POSITION_EDGES[-1]}+"]


POSITION_LABELS = _position_labels()
PROB_LABELS = _range_labels(PROB_EDGES, "[0.99, 1]")
ENTROPY_LABELS = _range_labels(ENTROPY_EDGES, f">= {_g(ENTROPY_EDGES[-1])}")
ROUTING_DELTA_LABELS = ["agrees", "differs", "unknown"]


@dataclass(frozen=True)
class MismatchConfig:
    """Thresholds taken from the run's config.yaml (``algo.*``) plus analysis options."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    top_k: int = 10
    breakdowns: bool = True
    routing: bool = True
    keep_abs: bool = True            # keep every |Δ| (float32) for exact percentiles: 4 bytes per token
    plot_points: int = 0             # > 0: keep up to this many (rollout, trainer) prob pairs for plots
    per_step_percentiles: bool = False  # p50/p99 of each step too (step tables only)
    # Compiled per-token passes (``kernels``, numba) or the numpy per-token path (``step_tokens`` +
    # ``add``): the same answer. None: decided by ``resolve_compiled`` from the size of the steps.
    compiled: bool | None = None
    # What the rollout logprob is compared with: the trainer's recompute (old_logprob) or, for an
    # on-policy distillation run, the teacher's (``TEACHER_COLUMN``; no routing, no Δ split then).
    against: str = "trainer"
    # Tokens (of whole samples) read and folded at a time: the analysis holds one such chunk of a
    # step's columns, whatever the step's size (``axrl.trace.chunks``).
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any] | None, **kw: Any) -> "MismatchConfig":
        algo = (config or {}).get("algo") or {}
        base = cls()
        return cls(clip_low=float(algo.get("clip_low", base.clip_low)),
                   clip_high=float(algo.get("clip_high", base.clip_high)),
                   tis_cap=float(algo.get("tis_cap", base.tis_cap)), **kw)

    def columns(self) -> tuple[list[str], list[str]]:
        """(required, optional) dataset paths for ``TraceReader.iter_columns``."""
        required = list(CORE_COLUMNS)
        if self.against == "teacher":
            required[required.index(TRAINER_COLUMN)] = TEACHER_COLUMN
        if self.breakdowns:
            required += list(BREAKDOWN_COLUMNS)
        if self.against == "teacher":
            return required, []
        return required, (list(ROUTING_COLUMNS) if self.routing else []) + [SPLIT_COLUMN]

    def compared(self, cols: Mapping[str, Any]) -> Mapping[str, Any]:
        """``cols`` as the analysis reads them: against the teacher, its column under the
        trainer's name (every pass then computes Δ = teacher − rollout unchanged)."""
        if self.against != "teacher":
            return cols
        return {(TRAINER_COLUMN if k == TEACHER_COLUMN else k): v for k, v in cols.items()}
