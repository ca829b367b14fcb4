"""The table of rollout↔trainer corrections (`algo.correction`). A correction is one module that
defines its per-token weight and registers it with `@correction(...)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from axrl.algo.registry import Registry
from axrl.algo.terms import CorrectionInputs, CorrectionTerms, LossRule

__all__ = ["Correction", "CORRECTIONS", "correction"]

WeightFn = Callable[[CorrectionInputs, BaseModel], CorrectionTerms]


@dataclass(frozen=True)
class Correction:
    """A registered correction: `terms(inputs, params)` gives a detached weight per token
    (multiplying the objective's loss) and the rule bits it set."""

    name: str
    terms: WeightFn
    params: type[BaseModel]
    rules: LossRule
    summary: str
    source: str


CORRECTIONS: Registry[Correction] = Registry("correction", "algo.correction")


def correction(name: str, *, params: type[BaseModel], rules: LossRule, summary: str,
               source: str) -> Callable[[WeightFn], WeightFn]:
    """Register the decorated function as the correction `name`."""
    def register(fn: WeightFn) -> WeightFn:
        CORRECTIONS.add(Correction(name, fn, params, rules, summary, source))
        return fn
    return register
