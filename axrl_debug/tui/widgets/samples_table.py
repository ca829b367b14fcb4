"""The samples table of one step: reward, length, turns, per-sample |Δ|, routing, status."""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
from rich.style import Style

from ..data import StepModel
from ..format import fmt, fmt3, fmt_int, fmt_str, pct
from .sortable_table import Column, SortableTable

SAMPLE_COLUMNS = [
    Column("row", "row", fmt_int, width=4, descending=False),
    Column("reward", "reward", fmt, width=7),
    Column("status", "status", fmt_str, width=6, descending=False),
    Column("finish", "finish", fmt_str, width=7, descending=False),
    Column("turns", "turns", fmt_int, width=5),
    Column("length", "len", fmt_int, width=5),
    Column("generated", "gen", fmt_int, width=5),
    Column("mean_abs", "mean|Δ|", fmt3, width=8),
    Column("max_abs", "max|Δ|", fmt3, width=8),
    Column("routing", "route", pct, width=6, descending=False),
    Column("advantage", "adv", fmt, width=7),
    Column("sample_id", "id", fmt_int, width=7, descending=False),
    Column("group_id", "grp", fmt_int, width=6, descending=False),
]
REPLAY_COLUMN = Column("replay_loss", "loss(replay)", fmt3, width=12)
FAILED_STYLE = Style(color="red")
FAILED_KEY_STYLE = Style(color="red", bold=True)

WORST_N = 10  # the "worst" filter keeps this many samples (largest max |Δ|)


def sample_records(step: StepModel) -> dict[int, dict[str, Any]]:
    """One record per sample row, keyed by the row (the index the /train arrays use)."""
    s = step.samples
    n = step.num_samples

    def col(name: str, default: Any = None) -> list[Any]:
        a = s.get(name)
        return [default] * n if a is None else np.asarray(a).tolist()

    st = step.stats
    reward, status, finish = col("reward", float("nan")), col("status", ""), col("finish_reason", "")
    turns, sid, gid, adv = col("num_turns"), col("sample_id"), col("group_id"), col("advantage", float("nan"))
    error = col("error", "")
    out: dict[int, dict[str, Any]] = {}
    for i in range(n):
        out[i] = {"row": i, "reward": reward[i], "status": status[i], "finish": finish[i], "turns": turns[i],
                  "length": step.length(i), "generated": int(step.generated[i]),
                  "mean_abs": float(st.mean_abs[i]), "max_abs": float(st.max_abs[i]),
                  "routing": float(st.routing_agree[i]), "advantage": adv[i], "sample_id": sid[i],
                  "group_id": gid[i], "error": error[i],
                  "replay_loss": None if step.replay_loss is None else float(step.replay_loss[i])}
    return out


class SamplesTable(SortableTable):
    """Samples of one step; failed ones in red."""

    def __init__(self, *, replay: bool = False, id: str | None = None) -> None:
        super().__init__(SAMPLE_COLUMNS + ([REPLAY_COLUMN] if replay else []), id=id)

    def cell_style(self, key: Hashable, column: Column, record: dict[str, Any]) -> Style | None:
        if record.get("status") not in ("ok", None, ""):
            return FAILED_KEY_STYLE if column.key in ("row", "status") else FAILED_STYLE
        return None
