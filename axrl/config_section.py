"""The base of every config section (axrl/config.py): unknown keys are refused, and values are
validated when set as well as when loaded."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
