"""What the ratio-based corrections share: the level the train/rollout ratio is taken at, and the
check of a [low, high] band."""

from __future__ import annotations

from typing import Literal

Level = Literal["token", "sequence", "geometric"]


def check_band(low: float, high: float, names: tuple[str, str]) -> None:
    """ValueError unless low < high (a band that keeps something)."""
    if not low < high:
        raise ValueError(f"{names[0]} ({low}) must be < {names[1]} ({high})")
