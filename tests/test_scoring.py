"""Teacher-forced scoring on servers (axrl/inference/scoring/base.py and its per-engine scorers), with
`axrl serve` as the server (no SGLang or vLLM environment needed; the real-engine versions of these
checks are in tests/test_sglang_real.py and tests/test_vllm_scoring.py):

- a served distillation teacher (`distill.url`) gives the local teacher's logprobs at the rollout
  temperature, and a served teacher with another tokenizer is refused;
- `axrl-debug replay --rollout --engine sglang --url … --load-weights` re-scores a recorded step
  on the server and reports its mismatch against the trainer on the recorded tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from axrl.algo.distill import DistillSettings
from axrl.cli import app as axrl_app
from axrl.core.errors import ConfigError
from axrl.inference.scoring import at_temperature, request_groups
from axrl.runtime.teacher import make_teacher
from axrl.tokenizer import Tokenizer
from axrl.train import TorchBackendConfig
from axrl.train.protocol import PackedBatch
from axrl_debug.cli import app as debug_app
from serve_util import launch, make_model_dir

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, launcher) of one `axrl serve` process on a tiny MoE."""
    model_dir = make_model_dir(tmp_path_factory.mktemp("scoring") / "teacher", seed=5)
    launcher = launch(model_dir)
    yield model_dir, launcher
    launcher.stop()


def _batch(temperature: float) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    lengths = [9, 40, 1, 23]
    ids = torch.randint(3, 1000, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *np.cumsum(lengths)])
    return PackedBatch(input_ids=ids, offsets=offsets, loss_mask=torch.ones(len(ids)), temperature=temperature)


def test_at_temperature_renormalises_logprobs_to_the_tempered_distribution():
    z = np.random.default_rng(0).normal(size=(5, 50)) * 3
    lp = torch.log_softmax(torch.tensor(z), -1).numpy()  # what a server reports at temperature 1
    targets = np.arange(5) * 7
    expected = torch.log_softmax(torch.tensor(z) / 0.6, -1).numpy()[np.arange(5), targets]
    np.testing.assert_allclose(at_temperature(lp, targets, 0.6), expected, atol=1e-6)
    assert request_groups([3, 4, 10, 2, 2], 7) == [[0, 1], [2], [3, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_teacher_equals_the_local_teacher(served, temperature):
    """distill.url (prefill-only /generate, batched) gives what distill.teacher gives on the same
    model directory: log_softmax(logits / T) of every token, 0 at each sample's first position."""
    model_dir, launcher = served
    local = make_teacher(DistillSettings(teacher=str(model_dir)), TorchBackendConfig(), Tokenizer.default(),
                         device=torch.device("cpu"), dtype=torch.float32)
    remote = make_teacher(DistillSettings(url=launcher.urls[0]), TorchBackendConfig(), Tokenizer.default(),
                          device=torch.device("cpu"), dtype=torch.float32)
    batch = _batch(temperature)
    want, got = local.score(batch), remote.score(batch)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float(got.abs().sum()) > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    remote.close()


def test_served_teacher_with_another_tokenizer_is_refused(served):
    from hf_checkpoint import train_tokenizer

    default = Tokenizer.default()
    other = Tokenizer(train_tokenizer(), default.config)
    with pytest.raises(ConfigError, match=r"distill.url .*tokenizer .*differs from the student's"):
        make_teacher(DistillSettings(url=served[1].urls[0]), TorchBackendConfig(), other,
                     device=torch.device("cpu"), dtype=torch.float32)


def test_replay_rescores_a_recorded_step_on_a_server(served, tmp_path, monkeypatch):
    """replay --rollout --engine sglang against `axrl serve` (which loads the step's policy): the
    mismatch of a server running the trainer's own float32 forward is float rounding, on exactly
    the tokens the recorded engine's report covers."""
    run = tmp_path / "run"
    args = ["train", str(ROOT / "examples" / "quickstart.yaml"), "--run-dir", str(run)]
    for s in ["steps=2", "warmup.steps=20", "eval.every=0", "data.prompts_per_step=2", "rollout.group_size=4",
              "checkpoint.every=1", "runtime.threads=1", "rollout.max_new_tokens=16"]:
        args += ["--set", s]
    trained = CliRunner().invoke(axrl_app, args)
    assert trained.exit_code == 0, trained.output
    url = served[1].urls[0]
    refused = CliRunner().invoke(debug_app, ["replay", str(run), "--step", "1", "--rollout", "--engine", "sglang",
                                             "--url", url])
    said = "".join(refused.output.split())  # the message as printed, without rich's line breaks
    assert refused.exit_code == 2 and "replay/step_000001_policy" in said and "--load-weights" in said
    monkeypatch.delenv("AXRL_VLLM_PYTHON", raising=False)
    nowhere = CliRunner().invoke(debug_app, ["replay", str(run), "--step", "1", "--rollout", "--engine", "vllm"])
    assert nowhere.exit_code == 2 and "--engine-python" in nowhere.output and "AXRL_VLLM_PYTHON" in nowhere.output
    misplaced = CliRunner().invoke(debug_app, ["replay", str(run), "--step", "1", "--rollout", "--url", url])
    assert misplaced.exit_code == 2 and "only with --engine sglang|vllm" in " ".join(misplaced.output.split())
    out = CliRunner().invoke(debug_app, ["replay", str(run), "--step", "1", "--rollout", "--engine", "sglang",
                                         "--url", url, "--load-weights", "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.stdout)
    mine, recorded = res["engine_mismatch"], res["recorded_mismatch"]
    assert res["compared_tokens"] == mine["tokens"]["analysed"] == recorded["tokens"]["analysed"] > 20
    assert mine["metrics"]["max_abs"] < 1e-5 and res["engine_vs_recorded"]["max_abs"] < 1e-5
    assert {r["bucket"] for r in mine["breakdowns"]["position"] if r["count"]} >= {"0 (first)"}
    assert res["model_dir"].endswith("replay/step_000001_policy") and res["temperature"] == 0.7
