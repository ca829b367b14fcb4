"""What the reader hands back: datasets of a step keyed by their path, with mapping-style access
(``StepColumns`` from ``TraceReader.iter_columns``; ``chunks.StepChunk`` reuses the access)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ColumnsByPath:
    """Mapping-style access to ``self.data`` (dataset path -> array), for the reader's results."""

    data: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.data


@dataclass(frozen=True)
class StepColumns(ColumnsByPath):
    """Datasets read from one step file by ``TraceReader.iter_columns``."""

    step: int
    path: Path
    attrs: dict[str, Any]
    data: dict[str, Any]
