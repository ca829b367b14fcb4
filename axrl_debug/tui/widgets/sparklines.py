"""Sparklines of the key per-step metrics over the run, above the steps table."""

from __future__ import annotations

import numpy as np
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.widget import Widget
from textual.widgets import Label, Sparkline

# (row key, label): reward and loss on the first line, grad norm and mismatch on the second;
# two lines of sparklines leave the table 17 rows at 80×24.
SPARK_METRICS = [("reward", "reward"), ("loss", "loss"), ("grad_norm", "gnorm"), ("mismatch", "mean|Δ|")]


def _clean(values: np.ndarray) -> list[float]:
    """Sparkline data without NaN (a gap shows as the series minimum); [0] when nothing is known."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.any():
        return [0.0]
    return np.where(finite, v, v[finite].min()).tolist()


class MetricSparklines(Widget):
    """Four labelled sparklines (max per column, so a one-step spike stays visible)."""

    def compose(self) -> ComposeResult:
        with Grid(id="spark-grid"):
            for key, label in SPARK_METRICS:
                with Horizontal(classes="spark-cell"):
                    yield Label(label, classes="spark-label")
                    yield Sparkline([0.0], summary_function=max, id=f"spark-{key}", classes="spark")

    def set_series(self, series: dict[str, np.ndarray]) -> None:
        for key, _ in SPARK_METRICS:
            if key in series:
                self.query_one(f"#spark-{key}", Sparkline).data = _clean(series[key])
