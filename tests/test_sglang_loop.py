"""`axrl train` with `rollout.engine=sglang`: the default example (shrunk) runs end to end on
`axrl serve` processes launched by the loop, with weights synced through a gloo process group,
and `axrl-debug mismatch` analyses its trace. A deterministic run clocks a server by request
rounds, which the served engine admits as one batch, so every sample's tokens, rollout logprobs
and routing equal an in-process run's on the same round schedule (`rollout.clock: rounds`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from axrl.config import load_config
from axrl.assembly.settings import rollout_settings
from axrl.inference.sglang.factory import server_command
from axrl.assembly.build import train

SHRINK = ["steps=2", "warmup.steps=5", "data.prompts_per_step=4", "rollout.group_size=4", "eval.every=0",
          "checkpoint.every=10", "r3=true"]
SGLANG = ["rollout.engine=sglang", "rollout.sglang.server=axrl", "rollout.sglang.weight_sync=distributed"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _samples(run, step: int) -> dict[int, dict[str, np.ndarray]]:
    """Per sample id: its tokens, rollout logprobs, policy versions and rollout routing."""
    with h5py.File(run / "trace" / f"step_{step:06d}.h5") as f:
        off = f["samples/offsets"][()]
        cols = {k: f[k][()] for k in ("tokens/ids", "tokens/rollout_logprob", "tokens/policy_version",
                                      "routing/rollout")}
        return {int(sid): {k: v[off[i]:off[i + 1]] for k, v in cols.items()}
                for i, sid in enumerate(f["samples/sample_id"][()])}


@pytest.mark.timeout(600)
def test_train_on_sglang_engine_end_to_end(tmp_path):
    run = tmp_path / "sglang"
    cmd = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart.yaml", "--run-dir", str(run)]
    for item in SHRINK + SGLANG:
        cmd += ["--set", item]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=540,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((run / "manifest.json").read_text())["engine"] == "sglang"

    mismatch = subprocess.run([sys.executable, "-m", "axrl_debug.cli", "mismatch", str(run), "--json"], env=ENV,
                              capture_output=True, text=True, timeout=300)
    assert mismatch.returncode == 0, mismatch.stderr[-3000:]
    report = json.loads(mismatch.stdout)
    print("axrl-debug mismatch on the sglang run:", json.dumps(report)[:600])

    embedded = tmp_path / "embedded"
    train(load_config("examples/quickstart.yaml", SHRINK + ["rollout.clock=rounds"]), embedded)
    for step in range(2):
        served, local = _samples(run, step), _samples(embedded, step)
        assert served.keys() == local.keys()
        for sid, cols in served.items():
            for key, value in cols.items():
                assert np.array_equal(value, local[sid][key], equal_nan=True), (step, sid, key)
    # Step 1 ran on the weights synced after step 0 (version 1), through the process group.
    versions = np.concatenate([c["tokens/policy_version"] for c in _samples(run, 1).values()])
    assert set(np.unique(versions)) == {-1, 1}  # -1: prompt and env tokens


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
@pytest.mark.parametrize("overrides, says", [
    ([], "sglang package is not installed here"),
    (["rollout.sglang.python=/nonexistent/bin/python"], "rollout.sglang.python='/nonexistent/bin/python' does not exist"),
])
def test_missing_sglang_is_a_clear_error(overrides, says):
    cfg = load_config("examples/quickstart.yaml", ["rollout.engine=sglang", *overrides])
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        server_command(cfg.rollout.sglang, rollout_settings(cfg).served)
    assert "rollout.sglang.server=axrl" in str(info.value) and "scripts/sglang-cpu-env.sh" in str(info.value)


@pytest.mark.parametrize("override, says", [
    ("rollout.sglang.urls=[localhost:30000]", "urls: 'localhost:30000' is not an http(s) URL"),
    ("rollout.sglang.server_args=[--port, '1']", "server_args: ['--port'] are set by the launcher"),
    ("rollout.sglang.weight_sync=nccl", "rollout.sglang.weight_sync"),
])
def test_bad_sglang_config_names_the_key(override, says):
    from axrl.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("examples/quickstart.yaml", ["rollout.engine=sglang", override])


def _datasets(path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        names: list[str] = []
        f.visit(lambda k: names.append(k) if isinstance(f[k], h5py.Dataset) else None)
        return {k: f[k][()] for k in names}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_server_runs_are_bitwise_repeatable(tmp_path):
    # Two servers answer each lock-step round in either order; the client hands the results back
    # in submission order, so the trace does not depend on which answered first.
    overrides = SHRINK + ["rollout.engine=sglang", "rollout.sglang.server=axrl", "rollout.sglang.num_servers=2"]
    for name in ("a", "b"):
        train(load_config("examples/quickstart.yaml", overrides), tmp_path / name)
    for step in range(2):
        a, b = (_datasets(tmp_path / n / "trace" / f"step_{step:06d}.h5") for n in ("a", "b"))
        assert a.keys() == b.keys()
        for key in a:
            x, y = np.asarray(a[key]), np.asarray(b[key])
            equal = np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
            assert equal, (step, key)
