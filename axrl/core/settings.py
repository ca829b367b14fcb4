"""`Section`, the base of every settings type: unknown keys are refused, and values are validated
when set as well as when loaded. Each component's settings type derives from it, so the YAML config
(`axrl/config/schema.py`), which composes them, and Python code get one set of defaults and one
validation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
