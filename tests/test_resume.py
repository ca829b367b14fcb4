"""What `--resume` tells the user and refuses, a run killed during its warm-up, and configs that
could not train on anything: the command line as a new user meets it."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from axrl.console.progress import TrainProgress
from train_util import train

TINY = ["steps=2", "model.preset=micro-moe", "warmup.steps=3", "data.task=echo", "data.task_args={}",
        "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "eval.every=0",
        "checkpoint.every=1", "runtime.threads=1"]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("resume") / "run"
    train(run, TINY)
    return run


def edited_config(tmp_path: Path, run: Path, **changes) -> Path:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        node = cfg
        *parents, last = key.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_resume_says_which_config_it_continues_with_and_what_it_ignored(done_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(done_run, run)
    given = edited_config(tmp_path, run, train__lr=0.5, rollout__temperature=0.3)
    result = train(run, ["steps=3"], "--resume", config=given)
    out = " ".join(result.output.split())
    assert f"resuming with the run's recorded config {run / 'config.yaml'}" in out
    assert "applied from --set: steps (2 → 3)" in out
    assert "ignored from" in out and "train.lr (0.0001 → 0.5)" in out and "rollout.temperature" in out
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["steps"] == 3 and recorded["train"]["lr"] == 1e-4  # the given file was not applied
    assert "UserWarning" not in result.output


@pytest.mark.parametrize("how", ["given", "set"])
def test_resume_refuses_keys_that_cannot_change_mid_run(done_run, tmp_path, how):
    run = tmp_path / "run"
    shutil.copytree(done_run, run)
    if how == "given":
        result = train(run, [], "--resume", config=edited_config(tmp_path, run, seed=7), check=False)
        assert "seed (0 → 7)" in " ".join(result.output.split())
    else:
        result = train(run, TINY + ["model.preset=tiny-moe"], "--resume", check=False)
        assert "model.preset ('micro-moe' → 'tiny-moe') cannot change mid-run" in " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(list((run / "trace").glob("step_*.h5"))) == 2  # nothing touched


def test_a_run_killed_in_its_warm_up_resumes_from_the_start(done_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "manifest.json"):  # what a run has written when its warm-up starts
        shutil.copy(done_run / name, run / name)
    result = train(run, TINY, "--resume")  # the original command + --resume
    assert "no checkpoint yet" in " ".join(result.output.split())
    assert sorted(p.name for p in (run / "trace").glob("*.h5")) == ["step_000000.h5", "step_000001.h5"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_a_context_that_cannot_hold_the_prompt_is_refused(tmp_path):
    result = train(tmp_path / "r", TINY + ["rollout.max_context_len=10"], check=False)
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "rollout.max_context_len=10 cannot hold the task's prompts" in out
    assert "renders to" in out and not (tmp_path / "r").exists()


def test_the_warm_up_has_a_progress_bar_of_its_own():
    buf = io.StringIO()
    with TrainProgress(5, console=Console(file=buf, width=100, force_terminal=True)) as progress:
        with progress.stage("warm-up", 3) as advance:
            for i in range(3):
                advance(f"loss {1.0 / (i + 1):.3f}")
            progress.progress.refresh()
            shown = buf.getvalue()
    assert "warm-up" in shown and "3/3" in shown and "loss 0.333" in shown
