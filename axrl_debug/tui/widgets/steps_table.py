"""The steps table: one row per step, spikes highlighted."""

from __future__ import annotations

from typing import Any, Hashable

from rich.style import Style

from ..format import fmt, fmt3, fmt_int, fmt_lag, pct
from .sortable_table import Column, SortableTable

# Short codes of the spike metrics (the spikes column must fit an 80-column terminal).
SPIKE_CODES = {"loss": "L", "grad_norm": "G", "mismatch": "Δ", "reward": "R"}

# Widths fit fmt()'s 4 significant digits ("-1.234e-05" is the widest, cut with … beyond);
# the first eight columns fit an 80-column terminal, the rest scroll in with ←/→.
STEP_COLUMNS = [
    Column("step", "step", fmt_int, width=5, descending=False),
    Column("spikes", "spike", lambda v: v or "", width=5),
    Column("reward", "reward", fmt, width=7),
    Column("loss", "loss", fmt, width=9),
    Column("grad_norm", "gnorm", fmt, width=7),
    Column("mismatch", "mean|Δ|", fmt3, width=8),
    Column("mismatch_max", "max|Δ|", fmt3, width=8),
    Column("routing_agreement", "route", pct, width=6, descending=False),   # low agreement first
    Column("kl_k3", "k3", fmt3, width=8),
    Column("clipfrac", "clip", pct, width=6),
    Column("version_lag_mean", "lag", fmt_lag, width=5),
    Column("generated_tokens", "gen", fmt_int, width=7),
    Column("failed", "failed", fmt_int, width=6),
]
SPIKE_STYLE = Style(color="red", bold=True)


def spike_text(spikes: list[dict[str, Any]]) -> str | None:
    """'L▲G▲' for spikes of loss and grad norm upwards; None when the step has none."""
    if not spikes:
        return None
    return "".join(SPIKE_CODES.get(s["metric"], s["metric"][:1].upper()) + ("▲" if s["direction"] == "up" else "▼")
                   for s in spikes)


class StepsTable(SortableTable):
    """Steps of the run (records from ``RunModel.rows`` plus a ``spikes`` entry)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(STEP_COLUMNS, id=id)
        self.spiked: dict[int, set[str]] = {}

    def cell_style(self, key: Hashable, column: Column, record: dict[str, Any]) -> Style | None:
        metrics = self.spiked.get(int(key))  # type: ignore[arg-type]
        if metrics and (column.key in ("step", "spikes") or column.key in metrics):
            return SPIKE_STYLE
        return None
