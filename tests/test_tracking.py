"""Experiment trackers (`logging.wandb`, `logging.mlflow`) with the real packages, offline: a short
run logs the same scalars as metrics.jsonl to a W&B offline run under RUN/wandb/ (read back with
wandb's own transaction-log reader, `wandb leet inspect --json`) and to MLflow's sqlite store under
RUN/mlflow/ (read back with `MlflowClient`), plus the reward plot; --resume continues both runs.
Nothing reaches the network: W&B offline mode, no login, MLflow local store, telemetry off."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from axrl.runtime.recording.metrics_log import MetricsLog
from axrl.runtime.recording.trackers import scalars
from axrl.trace import RunDir
from train_util import train

import mlflow  # noqa: E402,F401  (the test extra installs both: a broken import must fail, never skip)
import wandb  # noqa: E402,F401

SMALL = ["model.preset=micro-moe", "data.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
         "rollout.max_context_len=160", "warmup.steps=3", "warmup.batch_size=4", "checkpoint.every=2",
         "runtime.threads=1", "eval.every=2", "eval.prompts=2", "eval.samples_per_prompt=1"]
TRACKERS = ["logging.wandb={project: axrl-test, mode: offline}", "logging.mlflow={experiment: axrl-test}"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, no login, nothing written outside tmp_path."""
    home = tmp_path / "home"
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                       "WANDB_CONFIG_DIR": home / "config", "WANDB_CACHE_DIR": home / "cache",
                       "WANDB_DATA_DIR": home / "data", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "DO_NOT_TRACK": "true"}.items():
        monkeypatch.setenv(var, str(value))
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)


def _wandb_records(offline_run: Path) -> list[dict]:
    """The records of a W&B offline run, by wandb's own reader of its .wandb transaction log."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _per_step(points: list[tuple[int, str, float]]) -> dict[tuple[int, str], list[float]]:
    out: dict[tuple[int, str], list[float]] = {}
    for step, key, value in points:
        out.setdefault((step, key), []).append(value)
    return out


def test_wandb_and_mlflow_get_the_metrics_and_resume_continues_their_runs(tmp_path):
    run = tmp_path / "run"
    train(run, [*SMALL, "steps=3", *TRACKERS])
    ids = json.loads((run / "tracking.json").read_text())
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ids["mlflow"]["tracking_uri"] is None and ids["mlflow"]["experiment"] == "axrl-test"
    # Stopped after step 2 was recorded, with only checkpoint step_000002: --resume (extended to 4
    # steps) redoes steps 2 and 3 in the same W&B and MLflow runs.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000003")
    train(run, [*SMALL, "steps=4", *TRACKERS], "--resume")
    assert json.loads((run / "tracking.json").read_text()) == ids
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    expected = {(r["step"], k): v for r in rows for k, v in scalars(r).items()}
    assert {"reward", "loss", "grad_norm", "eval_reward", "eval_reward_final"} <= {k for _, k in expected}
    # The trackers keep what they were sent: also the discarded first try of step 2 (then the
    # last step, with `eval_reward_final`).
    sent = set(expected) | {(r["step"], k) for r in first for k in scalars(r)}
    assert (2, "eval_reward_final") in sent - set(expected)

    # -- W&B: two offline folders (the start and the resume), one run id
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith("-" + ids["wandb"]["id"]) for f in folders)
    points, images, starts = [], [], []
    for folder in folders:
        for rec in _wandb_records(folder):
            if rec["type"] == "run":
                starts.append((rec["run"]["run_id"], rec["run"].get("resume", False)))
            elif rec["type"] == "history":
                item = rec["history"]["item"]
                if "reward_plot._type" in item:  # a media value, flattened
                    images.append((folder, {k.partition(".")[2]: v for k, v in item.items()
                                            if k.startswith("reward_plot.")}))
                    continue
                points += [(item["step"], k, v) for k, v in item.items() if not k.startswith("_") and k != "step"]
    assert starts == [(ids["wandb"]["id"], False), (ids["wandb"]["id"], True)]
    logged = _per_step(points)
    assert set(logged) == sent  # the same scalars, no more
    for key, value in expected.items():  # a redone step is logged again: its last value is the recorded one
        assert logged[key][-1] == pytest.approx(value, rel=1e-12, abs=0), key
    assert len(logged[(2, "loss")]) == 2 and len(logged[(3, "loss")]) == 1
    assert len(images) == 2  # the reward plot at the end of each part, as a W&B image
    folder, image = images[-1]
    assert image["_type"] == "image-file" and (folder / "files" / image["path"]).is_file()

    # -- MLflow: the sqlite store and the artifacts under RUN/mlflow, one run
    from mlflow.tracking import MlflowClient

    assert (run / "mlflow" / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("axrl-test")
    found = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in found] == [ids["mlflow"]["run_id"]]
    mrun = found[0]
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "run"
    mpoints = [(m.step, key, m.value) for key in mrun.data.metrics
               for m in client.get_metric_history(mrun.info.run_id, key)]
    mlogged = _per_step(mpoints)
    assert set(mlogged) == sent
    for key, value in expected.items():
        assert value in mlogged[key], key
    assert len(mlogged[(2, "loss")]) == 2 and len(mlogged[(3, "loss")]) == 1
    assert sorted(a.path for a in client.list_artifacts(mrun.info.run_id)) == ["config.yaml", "reward.png"]
    artifacts = Path(mrun.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(run / "mlflow" / "artifacts")
    assert (artifacts / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_tracking_keys_are_config_errors(tmp_path):
    for override, needle in [
        ("logging.wandb={projct: x}", "logging.wandb.projct: unknown key"),
        ("logging.wandb={mode: onlin}", "logging.wandb.mode: Input should be 'online' or 'offline'"),
        ("logging.mlflow.tracking_url=file:/x", "logging.mlflow.tracking_url: unknown key"),
    ]:
        result = train(tmp_path / "r", [override], check=False)
        assert result.exit_code == 2 and needle in " ".join(result.output.split()), result.output
        assert not (tmp_path / "r").exists()


class _Broken:
    name = "broken"

    def __init__(self):
        self.closed = None

    def log(self, step, values):
        raise ConnectionError("tracking server down")

    def log_image(self, path, step):
        raise AssertionError("a dropped tracker gets no plot")

    def close(self, ok):
        self.closed = ok


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path):
    log = MetricsLog(RunDir(tmp_path / "run"))
    broken = _Broken()
    log._trackers = [broken]
    with pytest.warns(UserWarning, match="logging.broken: logging step 0 failed"):
        log.write({"step": 0, "reward": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.write({"step": 1, "reward": 0.7})
        log.close()
    assert broken.closed is False
    assert [r["step"] for r in RunDir(tmp_path / "run").read_metrics()] == [0, 1]
