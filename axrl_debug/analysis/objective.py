"""What the objective and the rollout↔trainer corrections did to the trained tokens, from the
trace's `/tokens/loss_rule` (bits, `axrl.trace.schema.LOSS_RULE_CODES`) and `/tokens/is_weight`
(the corrections' weight): per rule the share of loss tokens it touched, and the weight's spread.

    frac(rule)   = #{loss tokens with the rule's bit} / #{loss tokens}
    masked_frac  = #{loss tokens with is_weight = 0} / #{loss tokens}     (MIS, veto, IcePop)
    clipped_frac = #{loss tokens hard-clipped: clip_high | clip_low | dual_clip} / #{loss tokens}

Steps recorded before these columns existed contribute nothing (`tokens` counts what was read).
Used by `axrl-debug mismatch` (the whole selection) and `summary` (per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from axrl.trace import TraceReader
from axrl.trace.schema import LOSS_RULE_CODES

COLUMNS = ["/tokens/loss_mask"]
OPTIONAL = ["/tokens/loss_rule", "/tokens/is_weight"]
HARD_CLIP = 1 | 2 | 4   # clip_high | clip_low | dual_clip


@dataclass
class ObjectiveStats:
    """Counts folded over steps."""

    tokens: int = 0                                      # loss tokens with recorded rules
    rules: dict[int, int] = field(default_factory=lambda: {code: 0 for code in LOSS_RULE_CODES})
    clipped: int = 0
    masked: int = 0
    weight_sum: float = 0.0
    weight_min: float = math.inf
    weight_max: float = -math.inf
    weighted: int = 0                                    # loss tokens with a finite is_weight

    def add(self, cols: Mapping[str, Any]) -> None:
        rule = cols.get("/tokens/loss_rule")
        if rule is None:
            return
        lm = np.asarray(cols["/tokens/loss_mask"]) != 0
        r = np.asarray(rule)[lm].astype(np.int64)
        self.tokens += int(r.size)
        for code in self.rules:
            self.rules[code] += int(np.count_nonzero(r & code))
        self.clipped += int(np.count_nonzero(r & HARD_CLIP))
        w = cols.get("/tokens/is_weight")
        if w is not None:
            w = np.asarray(w, dtype=np.float64)[lm]
            w = w[np.isfinite(w)]
            if w.size:
                self.weighted += int(w.size)
                self.masked += int(np.count_nonzero(w == 0))
                self.weight_sum += float(w.sum())
                self.weight_min = min(self.weight_min, float(w.min()))
                self.weight_max = max(self.weight_max, float(w.max()))

    def _frac(self, n: int, of: int | None = None) -> float:
        d = self.tokens if of is None else of
        return n / d if d else math.nan

    def headline(self) -> dict[str, float]:
        """Flat per-step figures (summary's columns)."""
        out = {"clipped_frac": self._frac(self.clipped), "masked_frac": self._frac(self.masked, self.weighted),
               "is_weight_mean": self.weight_sum / self.weighted if self.weighted else math.nan}
        out.update({f"rule_{LOSS_RULE_CODES[c][0]}_frac": self._frac(n) for c, n in self.rules.items()})
        return out

    def report(self) -> dict[str, Any]:
        """The `objective` section of `axrl-debug mismatch --json`."""
        return {
            "tokens": self.tokens,
            "clipped_frac": self._frac(self.clipped),
            "masked_frac": self._frac(self.masked, self.weighted),
            "is_weight": {"mean": self.weight_sum / self.weighted if self.weighted else math.nan,
                          "min": self.weight_min if self.weighted else math.nan,
                          "max": self.weight_max if self.weighted else math.nan},
            "rules": [{"code": c, "rule": LOSS_RULE_CODES[c][0], "meaning": LOSS_RULE_CODES[c][1], "tokens": n,
                       "frac": self._frac(n)} for c, n in self.rules.items()],
        }


def objective_report(reader: TraceReader, steps: Iterable[int]) -> dict[str, Any]:
    """Rule fractions and weight statistics over the selected steps."""
    stats = ObjectiveStats()
    for sc in reader.iter_columns(COLUMNS, list(steps), optional=OPTIONAL):
        stats.add(sc.data)
    return stats.report()


def objective_by_step(reader: TraceReader, steps: Iterable[int]) -> dict[int, dict[str, float]]:
    """Per step: `ObjectiveStats.headline()` (only steps that recorded the rules)."""
    out: dict[int, dict[str, float]] = {}
    for sc in reader.iter_columns(COLUMNS, list(steps), optional=OPTIONAL):
        stats = ObjectiveStats()
        stats.add(sc.data)
        if stats.tokens:
            out[sc.step] = stats.headline()
    return out
