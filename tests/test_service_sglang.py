"""Opt-in suite: `axrl serve --training` sampling on a REAL SGLang server (`pytest -m sglang`), on
CPU through cpu_compat, driven by the official `tinker` SDK.

Needs the environment built by `scripts/sglang-cpu-env.sh DIR` (AXRL_SGLANG_PYTHON=DIR/bin/python;
without it these tests are skipped, which CI allows only in the pass that does not set it):

    AXRL_SGLANG_PYTHON=~/.cache/axrl/sglang-venv/bin/python scripts/test -m sglang tests/test_service_sglang.py

One service for the module (`rollout.engine=sglang`, `rollout.sglang.server=sglang`: it launches
the SGLang server on the served tiny-moe directory, with routed experts); one SDK session samples,
trains a step on its samples, saves sampler weights (loaded by `/update_weights_from_disk`),
samples again and trains a second step (tests/service_real_util.py). The tests then check what
that session saw.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import h5py
import pytest

from tests.service_real_util import Scenario, check_base_sampling, check_new_weights, check_step_mismatch, session_on

SGLANG_PYTHON = os.environ.get("AXRL_SGLANG_PYTHON", "")
SKIP_REASON = ("real-SGLang suite: set AXRL_SGLANG_PYTHON to the python of an environment built by "
               "scripts/sglang-cpu-env.sh DIR")
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(not SGLANG_PYTHON, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """The service on SGLang, the SDK session's results, and the SGLang port (the service is stopped)."""
    if not Path(SGLANG_PYTHON).is_file():
        pytest.fail(f"AXRL_SGLANG_PYTHON={SGLANG_PYTHON} does not exist; build it with scripts/sglang-cpu-env.sh DIR")
    return session_on("sglang", SGLANG_PYTHON, tmp_path_factory.mktemp("service-sglang"),
                      {"rollout.sglang.server": "sglang", "rollout.sglang.cpu_compat": "true"})


def test_sampled_tokens_carry_the_trainers_logprobs(session: Scenario) -> None:
    """At the served weights, SGLang's sampled logprobs and compute_logprobs equal the trainer's
    teacher-forced logprobs of the same tokens."""
    check_base_sampling(session)


def test_sampler_weights_reach_the_sglang_server(session: Scenario) -> None:
    """After a training step, save_weights_for_sampler's weights are what SGLang samples from: its
    outputs change (same seed), and its logprobs and prompt scores are the trainer's new ones."""
    check_new_weights(session)


def test_trace_records_both_steps_with_sglangs_routing(session: Scenario) -> None:
    """Each optim_step is a trace step whose sampler–trainer mismatch `axrl-debug mismatch` reads;
    the sampled datums bring the routing SGLang returned, which agrees with the trainer's."""
    run = session.service.run
    for step, seqs in ((0, session.before), (1, session.after)):
        with h5py.File(run / "trace" / f"step_{step:06d}.h5") as f:
            assert f["routing/rollout_valid"][:].sum() == sum(len(session.prompt) + len(s.tokens) - 1 for s in seqs)
        # the same weights on both sides: the float32 paths route alike
        assert check_step_mismatch(session, step)["routing"]["agreement"] > 0.9
    assert "sampling on sglang servers" in session.service.log_path.read_text(errors="replace")


def test_service_stops_its_sglang_server(session: Scenario) -> None:
    """The server was the real SGLang (its log says so), and stopping the service stops it."""
    assert "sglang" in next((session.service.run.parent / "sglang-logs").glob("server_*.log")).read_text(errors="replace")
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(session.times["sglang_port"]))) != 0
