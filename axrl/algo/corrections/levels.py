"""The parameter shared by the ratio-based corrections: at which level the train/rollout ratio is taken."""

from __future__ import annotations

from typing import Literal

Level = Literal["token", "sequence", "geometric"]
