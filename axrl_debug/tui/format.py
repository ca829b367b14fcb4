"""Cell formatting shared by the TUI tables (the numbers themselves use the CLI's ``fmt``/``pct``
so the TUI and ``axrl-debug summary`` print a value the same way)."""

from __future__ import annotations

from typing import Any

from axrl_debug.commands._common import fmt, fmt_number, pct

__all__ = ["fmt", "pct", "fmt3", "fmt_int", "fmt_str", "fmt_lag"]


def fmt3(x: Any) -> str:
    """3 significant digits: mismatch values are noise below that."""
    return fmt(x, 3)


def fmt_int(x: Any) -> str:
    return fmt_number(x, lambda v: str(int(v)))


def fmt_str(x: Any) -> str:
    return "–" if x is None or x == "" else str(x)


def fmt_lag(x: Any) -> str:
    return fmt_number(x, lambda v: f"{v:.2f}")
