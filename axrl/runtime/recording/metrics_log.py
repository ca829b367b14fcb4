"""Where a step's metrics go: `metrics.jsonl` always (strict JSON, one line per step) and, when
configured, TensorBoard event files in `RUN/tensorboard/` (`logging.tensorboard`), a Weights &
Biases run (`logging.wandb`) and an MLflow run (`logging.mlflow`) (axrl/runtime/recording/trackers.py)."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from axrl.runtime.recording.trackers import MlflowSettings, Tracker, WandbSettings, close_trackers, open_trackers, scalars
from axrl.trace import RunDir

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_HINT = "logging.tensorboard needs the tensorboard package: pip install 'axrl[tensorboard]'"


class MetricsLog:
    def __init__(self, run: RunDir, *, tensorboard: bool = False, wandb: WandbSettings | None = None,
                 mlflow: MlflowSettings | None = None, config: Mapping[str, Any] | None = None) -> None:
        """`config`: the resolved config as plain data (the W&B run's config)."""
        self.run = run
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's module imports the tensorboard package
                raise ImportError(TENSORBOARD_HINT) from e
            self._writer = SummaryWriter(str(run.path / TENSORBOARD_DIR))
        try:
            self._trackers: list[Tracker] = open_trackers(run, wandb=wandb, mlflow=mlflow, config=config or {})
        except BaseException:
            if self._writer is not None:
                self._writer.close()
            raise

    def write(self, metrics: Mapping[str, Any]) -> None:
        """Append the step's line; every finite number also becomes a TensorBoard scalar and a
        tracker metric."""
        self.run.append_metrics(metrics)
        if self._writer is None and not self._trackers:
            return
        step = int(metrics["step"])
        values = scalars(metrics)
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        for t in list(self._trackers):
            try:
                t.log(step, values)
            except Exception as e:  # noqa: BLE001 - a tracker (e.g. a remote server) must not stop the run
                warnings.warn(f"logging.{t.name}: logging step {step} failed ({e!r}); no longer logging to it "
                              "(metrics.jsonl keeps every step)")
                self._trackers.remove(t)
                close_trackers([t], ok=False)

    def close(self, ok: bool = True) -> None:
        """Close the writers; the trackers first get the run's reward plot and end their runs as
        finished (`ok`) or failed."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            close_trackers(self._trackers, ok=ok, run=self.run)
            self._trackers = []
