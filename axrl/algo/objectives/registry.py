"""The table of policy objectives (`algo.loss`). An objective is one module that defines its
per-token function and registers it with `@objective(...)` (docs/algorithms.md has the formulas)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from axrl.algo.registry import NoParams, Registry
from axrl.algo.terms import ClipBand, LossRule, ObjectiveTerms, TokenInputs

__all__ = ["Objective", "OBJECTIVES", "objective"]

TermsFn = Callable[[TokenInputs, ClipBand, BaseModel], ObjectiveTerms]


@dataclass(frozen=True)
class Objective:
    """A registered objective: `terms(inputs, band, params)` gives its per-token loss, ratio and
    rule bits; `rules` lists the bits it can set (the `rule_*_frac` metrics it reports)."""

    name: str
    terms: TermsFn
    params: type[BaseModel]
    rules: LossRule
    summary: str
    source: str


OBJECTIVES: Registry[Objective] = Registry("objective", "algo.loss")


def objective(name: str, *, rules: LossRule, summary: str, source: str,
              params: type[BaseModel] = NoParams) -> Callable[[TermsFn], TermsFn]:
    """Register the decorated function as the objective `name`."""
    def register(fn: TermsFn) -> TermsFn:
        OBJECTIVES.add(Objective(name, fn, params, rules, summary, source))
        return fn
    return register
