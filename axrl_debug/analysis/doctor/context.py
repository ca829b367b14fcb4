"""What every signature family reads: the steps' views, their mismatch against the envelope and the
flagged steps (outside it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from axrl_debug.analysis.doctor.data import StepView
from axrl_debug.analysis.envelope import Envelope


@dataclass
class Context:
    run: Path
    views: dict[int, StepView]
    per_step: dict[int, dict[str, Any]]      # step_stats + Envelope.judge (+ engine/staleness split)
    envelope: Envelope
    profile: Any = None          # profile.Profile of the flagged steps (None when none is flagged)

    @property
    def steps(self) -> list[int]:
        return sorted(self.views)

    @property
    def flagged(self) -> list[int]:
        """Steps whose engine mismatch is outside the envelope."""
        return [s for s in self.steps if not self.per_step[s]["inside"]]

    def pooled(self, steps: list[int], fn: Callable[[StepView], np.ndarray]) -> np.ndarray:
        """`fn(view)` of each step in `steps`, concatenated."""
        parts = [fn(self.views[s]) for s in steps]
        return np.concatenate(parts) if parts else np.zeros(0)

    def engine_delta(self, view: StepView) -> np.ndarray:
        """|Δ| that is the engine's: Δ_engine where the trace splits Δ, else Δ itself; NaN where not analysed."""
        d = view.delta.copy()
        if view.behaviour is not None:
            beh = view.behaviour.astype(np.float64)
            d = np.where(np.isfinite(beh), beh - view.rollout.astype(np.float64), d)
        d[~view.analysed] = np.nan
        return np.abs(d)

    def floor(self) -> float:
        """The envelope's bound on a step's mean |Δ|."""
        return self.envelope.mean_abs

    def cmd(self, command: str, step: int | None = None) -> str:
        """`axrl-debug COMMAND RUN [--step N]`."""
        return f"axrl-debug {command} {self.run}" + (f" --step {step}" if step is not None else "")


def mean(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(a.mean()) if len(a) else math.nan


def ratio(a: float, b: float, floor: float) -> float:
    """a / b with b held at least at `floor` (a ratio of two numbers at the rounding floor is noise)."""
    return a / max(b, floor) if math.isfinite(a) and math.isfinite(b) else math.nan
