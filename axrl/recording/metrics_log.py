"""Where a step's metrics go: `metrics.jsonl` always (strict JSON, one line per step) and, with
`logging.tensorboard: true`, TensorBoard event files in `RUN/tensorboard/`."""

from __future__ import annotations

import math
from typing import Any, Mapping

from axrl.trace import RunDir

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_HINT = "logging.tensorboard needs the tensorboard package: pip install 'axrl[tensorboard]'"


class MetricsLog:
    def __init__(self, run: RunDir, *, tensorboard: bool = False) -> None:
        self.run = run
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's module imports the tensorboard package
                raise ImportError(TENSORBOARD_HINT) from e
            self._writer = SummaryWriter(str(run.path / TENSORBOARD_DIR))

    def write(self, metrics: Mapping[str, Any]) -> None:
        """Append the step's line; every finite number also becomes a TensorBoard scalar."""
        self.run.append_metrics(metrics)
        if self._writer is None:
            return
        step = int(metrics["step"])
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
