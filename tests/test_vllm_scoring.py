"""Teacher-forced scoring on a REAL vLLM server (`pytest -m vllm`): the vLLM scorer
(axrl/inference/scoring/vllm.py) and `axrl-debug replay --rollout --engine vllm`.

Needs the vLLM environment (scripts/vllm-cpu-env.sh DIR); point the suite at its interpreter with
AXRL_VLLM_PYTHON=DIR/bin/python (without it these tests are skipped):

    AXRL_VLLM_PYTHON=/work/vllm-venv/bin/python scripts/test -m vllm tests/test_vllm_scoring.py

One server for the module: a short embedded-engine run of the quickstart (tiny-moe, which vLLM's
CPU kernels serve), its step-1 policy exported where replay exports it, and vLLM launched on that
directory by replay's own launcher (`replay.server_rescore.scoring_server`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from train_util import SHORT_RUN, debug, train

VLLM_PYTHON = os.environ.get("AXRL_VLLM_PYTHON", "")
SKIP_REASON = "real-vLLM suite: set AXRL_VLLM_PYTHON to the python of an environment built by scripts/vllm-cpu-env.sh DIR"
LOGPROB_TOL = 1e-4  # float32 on both sides; measured max |Δ| ≈ 1e-6 on tiny-moe

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(run dir, exported step-1 policy, url) with vLLM launched on the policy."""
    from replay.policy import policy_before
    from replay.server_rescore import ServerOptions, model_dir_for, scoring_server

    if not Path(VLLM_PYTHON).is_file():
        pytest.fail(f"AXRL_VLLM_PYTHON={VLLM_PYTHON} does not exist; build it with scripts/vllm-cpu-env.sh DIR")
    run = tmp_path_factory.mktemp("vllm-scoring") / "run"
    train(run, SHORT_RUN)
    state = policy_before(run, 1)
    try:
        model_dir = state.backend.export_hf(model_dir_for(run, 1))
        opts = ServerOptions(python=VLLM_PYTHON, log_dir=run / "vllm-logs")
        with scoring_server("vllm", opts, model_dir, state.cfg, "float32", lambda msg: None) as (url, _):
            yield run, model_dir, url
    finally:
        state.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_scorer_gives_the_trainer_logprobs(served, temperature):
    """Prompt logprobs from /v1/completions against a direct forward of the same weights; at T != 1
    through the whole distribution (vLLM's prompt logprobs are at temperature 1)."""
    from axrl.inference.scoring import EmbeddedScorer
    from axrl.inference.scoring.vllm import VLLMScorer
    from axrl.model import load_hf

    _, model_dir, url = served
    model = load_hf(model_dir)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (1, 2, 17, 120)]
    scorer = VLLMScorer(url, vocab_size=model.config.vocab_size)
    try:
        got = scorer.score(seqs, temperature)
    finally:
        scorer.close()
    want = EmbeddedScorer(model).score(seqs, temperature)
    for g, w in zip(got, want):
        assert np.isnan(g[0])
        np.testing.assert_allclose(g[1:], w[1:], atol=LOGPROB_TOL, rtol=0)


def test_replay_rescores_a_recorded_step_on_vllm(served):
    """replay --rollout --engine vllm --url: vLLM's mismatch against the trainer on the recorded
    tokens is float32 rounding, over the same tokens as the recorded engine's report."""
    run, _, url = served
    out = debug("replay", run, "--step", 1, "--rollout", "--engine", "vllm", "--url", url, "--json")
    assert out.exit_code == 0, out.output
    res = json.loads(out.stdout)
    m = res["engine_mismatch"]
    assert m["tokens"]["analysed"] == res["recorded_mismatch"]["tokens"]["analysed"] > 100
    assert m["metrics"]["mean_abs"] < 1e-5 and m["metrics"]["max_abs"] < LOGPROB_TOL, m["metrics"]
    assert torch.isfinite(torch.tensor(res["engine_vs_recorded"]["mean_abs"]))
