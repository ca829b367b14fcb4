"""`axrl train` end to end: config validation, the trace it writes, checkpoints, resume, SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from axrl.config import ConfigError, load_config
from axrl.trace import TraceReader
from train_util import ROOT, train, train_command

# A few seconds per run: micro model, few short episodes, a short warm-up so episodes end.
SMALL = ["model.preset=micro-moe", "steps=4", "data.prompts_per_step=2", "rollout.group_size=4",
         "rollout.max_new_tokens=24", "rollout.max_context_len=160", "warmup.steps=3", "warmup.batch_size=4",
         "checkpoint.every=2", "runtime.threads=1", "eval.every=2", "eval.prompts=2",
         "eval.samples_per_prompt=1"]


@pytest.mark.parametrize("override,needle", [
    ("rollout.group_size=0", "rollout.group_size: Input should be greater than or equal to 1"),
    ("rollout.grup_size=4", "rollout.grup_size: unknown key"),
    ("train.lr=fast", "train.lr: Input should be a valid number"),
    ("rollout.engine=tgi", "rollout.engine: Input should be 'embedded', 'sglang' or 'vllm'"),
    ("steps", "expected key=value"),
])
def test_bad_config_is_rejected_before_any_work(tmp_path, override, needle):
    result = train(tmp_path / "r", [override], check=False)
    assert result.exit_code == 2
    assert needle in " ".join(result.output.split())
    assert not (tmp_path / "r").exists()


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_every_example_config_is_valid():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.steps >= 1 and cfg.rollout.engine in ("embedded", "sglang")


def test_train_writes_a_complete_trace(tmp_path):
    run = tmp_path / "run"
    train(run, SMALL)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "manifest.json",
                                                     "metrics.jsonl", "trace"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["seed"] == 0 and manifest["threads"] == 1 and manifest["schema_version"] == 1
    reader = TraceReader(run)
    assert reader.steps == [0, 1, 2, 3] and not reader.problems
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert ["eval_reward" in r for r in rows] == [True, False, True, False] and "eval_reward_final" in rows[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000", "step_000002", "step_000004"]

    with h5py.File(run / "trace" / "step_000002.h5") as f:
        off = f["samples/offsets"][:]
        assert len(off) == 2 * 4 + 1
        mask = f["tokens/loss_mask"][:].astype(bool)
        rollout = f["tokens/rollout_logprob"][:]
        old = f["tokens/old_logprob"][:]
        version = f["tokens/policy_version"][:]
        # Generated tokens, and only those, carry rollout logprobs and the generating version.
        generated = ~np.isnan(rollout)
        assert (mask <= generated).all() and (version[generated] == 2).all() and (version[~generated] == -1).all()
        # A real but tiny train/inference mismatch (fp32 KV-cache decode vs full forward).
        diff = np.abs(old[mask] - rollout[mask])
        assert diff.max() < 1e-3
        assert rows[2]["mismatch"] == pytest.approx(float(diff.mean()), rel=1e-5)
        assert f["routing/rollout"].shape[0] == off[-1] and f["routing/train"].shape == f["routing/rollout"].shape
        assert f["train/updates/loss"][0] == pytest.approx(rows[2]["loss"], rel=1e-6)
        if np.any(f["tokens/advantage"][:] != 0):  # all-equal rewards in every group give no gradient
            assert f["train/weights_fingerprint_before"][()] != f["train/weights_fingerprint_after"][()]
    # Consecutive steps chain: the weights a step ends with are the next step's starting weights.
    fps = []
    for s in reader.steps:
        with h5py.File(run / "trace" / f"step_{s:06d}.h5") as f:
            fps.append((f["train/weights_fingerprint_before"][()], f["train/weights_fingerprint_after"][()]))
    assert all(fps[i][1] == fps[i + 1][0] for i in range(len(fps) - 1))


def test_same_seed_same_run(tmp_path):
    """Determinism: two runs with one seed and config record the same losses and weights."""
    overrides = SMALL + ["steps=2"]
    train(tmp_path / "a", overrides)
    train(tmp_path / "b", overrides)
    for step in (0, 1):
        with h5py.File(tmp_path / "a" / "trace" / f"step_{step:06d}.h5") as a, \
                h5py.File(tmp_path / "b" / "trace" / f"step_{step:06d}.h5") as b:
            assert np.array_equal(a["tokens/ids"][:], b["tokens/ids"][:])
            # Bitwise, including the engine's logprobs: lock-step rollout fixes batch composition.
            assert a["tokens/rollout_logprob"][:].tobytes() == b["tokens/rollout_logprob"][:].tobytes()
            assert a["train/updates/loss"][:].tobytes() == b["train/updates/loss"][:].tobytes()
            assert a["train/weights_fingerprint_after"][()] == b["train/weights_fingerprint_after"][()]


def test_refuses_to_overwrite_a_run_and_resume_needs_a_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "something").write_text("x")
    result = train(tmp_path / "run", SMALL, check=False)
    assert result.exit_code == 2 and "not empty" in result.output
    result = train(tmp_path / "nothing", SMALL, "--resume", check=False)
    assert result.exit_code == 2 and "not a run directory" in " ".join(result.output.split())


def test_resume_redoes_steps_after_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    train(run, SMALL + ["steps=3"])
    # Pretend the run stopped after step 2 was recorded but only checkpoint step_000002 exists.
    # Then extend it to 4 steps: steps 2 and 3 are (re)done, each recorded once.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000003")
    train(run, SMALL + ["steps=4"], "--resume")
    assert TraceReader(run).steps == [0, 1, 2, 3]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((run / "manifest.json").read_text())["resumes"][0]["from_step"] == 2
    assert load_config(run / "config.yaml").steps == 4  # the recorded config follows the resumed run


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_finishes(tmp_path):
    """Kill the trainer with SIGKILL mid-run several times; the trace stays valid and --resume finishes."""
    run = tmp_path / "run"
    steps = 6
    cmd = train_command(run, SMALL + [f"steps={steps}", "checkpoint.every=1"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(1234)
    first = True
    for attempt in range(4):
        proc = subprocess.Popen(cmd + ([] if first else ["--resume"]), env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + rng.uniform(2.0, 7.0)
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        if (run / "config.yaml").exists() and (run / "checkpoints" / "step_000000").exists():
            first = False
        # Whatever the moment of death, every final step file is complete and readable.
        reader = TraceReader(run) if (run / "manifest.json").exists() else None
        if reader is not None:
            assert not reader.problems, reader.problems
            for s in reader.steps:
                reader.read(s)
    done = subprocess.run(cmd + ([] if first else ["--resume"]), env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    reader = TraceReader(run)
    assert reader.steps == list(range(steps)) and not reader.problems
    assert not list((run / "trace").glob("*.tmp"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))


def test_r3_replays_rollout_routing_in_the_trainer(tmp_path):
    """With r3 on, the trainer's forward uses exactly the experts the engine reported."""
    run = tmp_path / "run"
    train(run, SMALL + ["steps=2", "r3=true"])
    with h5py.File(run / "trace" / "step_000001.h5") as f:
        valid = f["routing/rollout_valid"][:].astype(bool)
        rollout, trainer = f["routing/rollout"][:], f["routing/train"][:]
        assert valid.sum() > 0
        assert np.array_equal(rollout[valid], trainer[valid])
