"""Experiment trackers beside metrics.jsonl: Weights & Biases (`logging.wandb`) and MLflow
(`logging.mlflow`). Each gets every finite scalar of every step (the same numbers as the step's
metrics.jsonl line, against the metric `step`) and, at the end of the run, the reward plot of
`examples/plot_reward.py` as an image.

Everything stays under the run directory unless the config says otherwise:

```
RUN/tracking.json                     the trackers' run ids: a resumed run continues the same runs
RUN/wandb/offline-run-<time>-<id>/    W&B's files (one folder per start, all with the run's id)
RUN/mlflow/mlflow.db                  MLflow's default store (sqlite) ...
RUN/mlflow/artifacts/                 ... and its artifacts
```
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

from pydantic import BaseModel, ConfigDict, Field

from axrl.runtime.recording.reward_plot import save_reward_plot
from axrl.trace import RunDir
from axrl.trace.run_dir import atomic_write_text

TRACKING_FILE = "tracking.json"
WANDB_DIR = "wandb"
MLFLOW_DIR = "mlflow"
REWARD_PLOT = "reward.png"
WANDB_HINT = "logging.wandb needs the wandb package: pip install 'axrl[tracking]'"
MLFLOW_HINT = ("logging.mlflow needs mlflow (mlflow-skinny, with sqlalchemy and alembic for its sqlite store): "
               "pip install 'axrl[tracking]'")


class WandbSettings(BaseModel):
    """`logging.wandb` (the YAML section is this type): a W&B run in RUN/wandb/."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str = Field("axrl", min_length=1, description="W&B project")
    mode: Literal["online", "offline"] = Field("offline", description="offline: local files only (`wandb sync "
                                               "RUN/wandb` uploads them later); online: also stream them "
                                               "(needs `wandb login`)")
    entity: str | None = Field(None, description="W&B entity (user or team); null: your default")
    name: str | None = Field(None, description="run name; null: the run directory's name")


class MlflowSettings(BaseModel):
    """`logging.mlflow` (the YAML section is this type): an MLflow run; the reward plot and
    config.yaml go with it as artifacts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: str | None = Field(None, description="MLflow tracking URI (a server, sqlite:///..., ...); "
                                     "null: a sqlite store in RUN/mlflow/")
    experiment: str = Field("axrl", min_length=1, description="MLflow experiment (created if missing)")
    run_name: str | None = Field(None, description="run name; null: the run directory's name")


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The step's finite numbers other than `step` (what TensorBoard and the trackers get; a
    non-finite value is null in metrics.jsonl and left out here)."""
    return {k: v for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker(Protocol):
    name: str

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_image(self, path: Path, step: int) -> None: ...

    def close(self, ok: bool) -> None: ...

    def ids(self) -> dict[str, Any]: ...


# ------------------------------------------------------------------------------ Weights & Biases

class WandbTracker:
    name = "wandb"

    def __init__(self, run: RunDir, s: WandbSettings, stored: Mapping[str, Any] | None,
                 config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(WANDB_HINT) from e
        self._wandb = wandb
        self.settings = s
        # The stored run continues when it is the same project; another project gets a new run.
        same = bool(stored) and stored.get("project") == s.project and stored.get("entity") == s.entity
        self._run = wandb.init(
            project=s.project, entity=s.entity, name=s.name or run.path.name, mode=s.mode,
            dir=str(run.path),  # wandb writes RUN/wandb/...
            id=stored["id"] if same else None, resume="allow" if same else None, config=dict(config),
            # create_new: leave any wandb run of the caller (and the global `wandb.run`) alone;
            # console off: the progress display keeps the terminal; no system-metrics sampler.
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")  # every metric against our step, never wandb's own

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log({"step": step, **values})

    def log_image(self, path: Path, step: int) -> None:
        self._run.log({"step": step, "reward_plot": self._wandb.Image(str(path), caption="reward")})

    def close(self, ok: bool) -> None:
        self._run.finish(exit_code=0 if ok else 1)

    def ids(self) -> dict[str, Any]:
        return {"id": self._run.id, "project": self.settings.project, "entity": self.settings.entity}


# ------------------------------------------------------------------------------------------ MLflow

class MlflowTracker:
    name = "mlflow"

    def __init__(self, run: RunDir, s: MlflowSettings, stored: Mapping[str, Any] | None) -> None:
        try:
            from mlflow.entities import Metric
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(MLFLOW_HINT) from e
        self._metric = Metric
        self.settings = s
        self.run = run
        uri = s.tracking_uri
        artifacts = None
        if uri is None:  # the run's own store: RUN/mlflow/mlflow.db, artifacts in RUN/mlflow/artifacts
            store = run.path.resolve() / MLFLOW_DIR
            store.mkdir(exist_ok=True)
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None
        if stored and stored.get("tracking_uri") == s.tracking_uri and stored.get("experiment") == s.experiment:
            try:
                self.client.update_run(stored["run_id"], status="RUNNING")
                self.run_id = stored["run_id"]
            except MlflowException as e:
                warnings.warn(f"logging.mlflow: cannot continue run {stored['run_id']} ({e}); starting a new one")
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(s.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                s.experiment, artifact_location=artifacts)
            self.run_id = self.client.create_run(exp_id, run_name=s.run_name or run.path.name,
                                                 tags={"axrl.run_dir": str(run.path.resolve())}).info.run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        ms = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_image(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))
        if self.run.config_path.is_file():  # the resolved config, as the run continues
            self.client.log_artifact(self.run_id, str(self.run.config_path))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")

    def ids(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.settings.tracking_uri,
                "experiment": self.settings.experiment}


# ------------------------------------------------------------------------------------ the run's set

def read_ids(run: RunDir) -> dict[str, Any]:
    path = run.path / TRACKING_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def open_trackers(run: RunDir, *, wandb: WandbSettings | None, mlflow: MlflowSettings | None,
                  config: Mapping[str, Any]) -> list[Tracker]:
    """Open the configured trackers, continuing the runs RUN/tracking.json names (a resume), and
    record their ids there."""
    if wandb is None and mlflow is None:
        return []
    stored = read_ids(run)
    trackers: list[Tracker] = []
    try:
        if wandb is not None:
            trackers.append(WandbTracker(run, wandb, stored.get("wandb"), config))
        if mlflow is not None:
            trackers.append(MlflowTracker(run, mlflow, stored.get("mlflow")))
    except BaseException:
        close_trackers(trackers, ok=False)
        raise
    ids = dict(stored) | {t.name: t.ids() for t in trackers}
    if ids != stored:
        atomic_write_text(run.path / TRACKING_FILE, json.dumps(ids, indent=2) + "\n")
    return trackers


def close_trackers(trackers: list[Tracker], *, ok: bool, run: RunDir | None = None) -> None:
    """Log the reward plot of the whole run (metrics.jsonl) to each tracker, then close them all
    (one that fails to close is reported; the others still close)."""
    if not trackers:
        return
    with tempfile.TemporaryDirectory() as tmp:
        png, rows = None, []
        try:
            rows = run.read_metrics() if run is not None else []
            if rows:
                png = save_reward_plot([(run.path.name, rows)], Path(tmp) / REWARD_PLOT)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"the reward plot could not be drawn: {e!r}")
        for t in trackers:
            try:
                if png is not None:
                    t.log_image(png, int(rows[-1]["step"]))
            except Exception as e:  # noqa: BLE001 - the run's own record (metrics.jsonl) is complete
                warnings.warn(f"logging.{t.name}: could not log the reward plot: {e!r}")
            try:
                t.close(ok)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"logging.{t.name}: could not close its run: {e!r}")


__all__ = ["MLFLOW_DIR", "TRACKING_FILE", "WANDB_DIR", "MlflowSettings", "MlflowTracker", "Tracker",
           "WandbSettings", "WandbTracker", "close_trackers", "open_trackers", "read_ids", "scalars"]
