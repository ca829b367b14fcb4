"""Rollout replay (`replay/rollout.py`, `axrl-debug replay --rollout`): a recorded step's rollout
re-run on the embedded engine is bitwise the trace's, for a synchronous and a deterministic
asynchronous run; a planted engine-weight change is reported at the right first token; runs that
cannot be replayed say why and point at the teacher-forced check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl.trace import StepFile
from axrl_debug.cli import app as debug_app
from replay import ReplayInputError
from replay.rollout import replay_rollout, teacher_forced_check

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["model.preset=micro-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
         "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
         "checkpoint.every=1", "rollout.max_new_tokens=12"]


def train(path: Path, *settings: str) -> Path:
    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in [*SMALL, *settings]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("rollout") / "sync", "steps=2")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("rollout") / "async", "steps=3", "runtime.mode=async", "checkpoint.quiescent=false",
                 "rollout.max_staleness=1")


def test_sync_rollout_replays_bitwise(sync_run):
    result = replay_rollout(sync_run, 1)
    assert result.verdict == "bitwise-equal", result.first_divergence
    assert [s.step for s in result.steps] == [1]
    assert result.steps[0].samples == 8 and result.steps[0].tokens > 0
    out = CliRunner().invoke(debug_app, ["replay", str(sync_run), "--step", "1", "--rollout", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "bitwise-equal"


def test_async_rollout_replays_bitwise_from_the_start(async_run):
    with StepFile(async_run / "trace" / "step_000002.h5") as sf:
        versions = sf["/tokens/policy_version"]
    assert (versions[versions >= 0] < 2).any()  # the engine ran ahead: tokens of older versions
    result = replay_rollout(async_run, 2)
    assert result.verdict == "bitwise-equal", result.first_divergence
    assert [s.step for s in result.steps] == [0, 1, 2] and not result.train_mismatches


def test_planted_engine_weight_is_reported_at_the_first_token_it_changes(sync_run):
    # Perturb the embedding row of one generated token id, in the engine only: the first token whose
    # prediction reads it (the one after its first occurrence as input) is the first to differ.
    with StepFile(sync_run / "trace" / "step_000001.h5") as sf:
        off, ids, sids = sf["/samples/offsets"], sf["/tokens/ids"], sf["/samples/sample_id"]
        lp = sf["/tokens/rollout_logprob"]
    gen = np.isfinite(lp)
    first_sid = int(sids.min())
    r = int(np.flatnonzero(sids == first_sid)[0])
    a, b = int(off[r]), int(off[r + 1])
    g = np.flatnonzero(gen[a:b])
    prompt_ids = set(ids[a:a + g[0]].tolist())
    target = next(int(ids[a + t]) for t in g[:-1] if int(ids[a + t]) not in prompt_ids)
    expected = next(t for t in g if target in ids[a:a + t].tolist())

    def plant(weights):
        w = dict(weights)
        emb = w["model.embed_tokens.weight"].clone()
        emb[target] += 0.05
        w["model.embed_tokens.weight"] = emb
        return w

    result = replay_rollout(sync_run, 1, engine_weights=plant)
    d = result.first_divergence
    assert result.verdict == "diverged"
    assert (d.sample_id, d.token) == (first_sid, expected), d.describe()
    assert d.field in ("rollout_logprob", "routing")


def test_runs_that_cannot_be_replayed_say_why_and_the_nearest_check(sync_run, tmp_path):
    for key, value, why in (("runtime", {"deterministic": False}, "runtime.deterministic: false"),
                            ("rollout", {"engine": "sglang"}, "rollout.engine=sglang")):
        copy = tmp_path / key
        shutil.copytree(sync_run, copy)
        cfg = yaml.safe_load((copy / "config.yaml").read_text())
        cfg[key].update(value)
        (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
        with pytest.raises(ReplayInputError, match="cannot be replayed bit for bit") as e:
            replay_rollout(copy, 1)
        assert why in str(e.value) and "--engine embedded" in str(e.value)
        out = CliRunner().invoke(debug_app, ["replay", str(copy), "--step", "1", "--rollout"])
        assert out.exit_code == 2
    # The nearest check: the recorded streams through the embedded decode path.
    out = CliRunner().invoke(debug_app, ["replay", str(copy), "--step", "1", "--rollout", "--engine", "embedded",
                                         "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["kind"] == "teacher-forced" and doc["engine"] == "sglang"
    # This run's rollouts came from the embedded engine, so its decode path reproduces them — without the
    # clock's schedule (the config now says sglang) the requests of a turn are batched together and their
    # prompts prefilled whole (the run's prefix cache is not mirrored), so bit for bit only where those
    # shapes are the ones it ran (~3/4 of the tokens), else to fp32 rounding.
    f = doc["fidelity"]
    assert f["tokens"] > 0 and f["bitwise_equal"] >= 0.5 * f["tokens"] and f["max_abs_diff"] < 1e-5
    assert f["cached_prompt_tokens"] == 0
    assert doc["summary"]["mean_abs_embedded_vs_recorded"] < 1e-6


def test_teacher_forced_check_sets_three_logprobs_side_by_side(sync_run):
    # On a synchronous deterministic run the decode path replays the clock's own batching (admission,
    # slots, prefill chunks, decode rows), so it reproduces every recorded rollout logprob bit for bit.
    result = teacher_forced_check(sync_run, 1, top=3)
    s = result.summary
    assert result.tokens > 0 and len(result.rows) == 3
    assert result.fidelity["bitwise_equal"] == result.fidelity["tokens"] == result.tokens
    assert s["mean_abs_embedded_vs_recorded"] == 0.0
    assert s["mean_abs_trainer_vs_embedded"] == s["mean_abs_trainer_vs_recorded"] > 0
    assert result.verdict.startswith("the trainer's side")
    assert {"recorded", "embedded", "trainer"} <= set(result.rows[0])
