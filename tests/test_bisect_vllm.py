"""`axrl-debug bisect --engine vllm` against a REAL vLLM server (`pytest -m vllm`; skipped without
AXRL_VLLM_PYTHON, see tests/test_vllm_real.py): the server runs AxRL's worker extension
(axrl/inference/vllm/probe_extension.py); one expert's weights perturbed in the served copy only
are named with their layer, `expert_out`, the expert and the positions routed to it, every point
before it within its floor. The model is tiny-moe: vLLM's CPU attention has no kernel for
micro-moe's head_dim 8."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from axrl.trace import StepFile
from replay.bisect import bisect_step
from replay.server_rescore import ServerOptions

VLLM_PYTHON = os.environ.get("AXRL_VLLM_PYTHON", "")
SMALL = ["steps=1", "model.preset=tiny-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
         "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
         "checkpoint.every=1", "rollout.max_new_tokens=12", "train.micro_batch_tokens=200"]
EXPERT = (1, 2)  # (layer, expert) perturbed in the served copy only


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="real-vLLM suite: set AXRL_VLLM_PYTHON (scripts/vllm-cpu-env.sh)")
def test_expert_perturbed_in_the_served_copy_is_named_on_vllm(tmp_path):
    from train_util import train

    run = tmp_path / "run"
    train(run, SMALL)
    layer, expert = EXPERT

    def perturb(weights):
        w = dict(weights)
        key = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
        w[key] = w[key] * 1.05
        return w

    opts = ServerOptions(python=VLLM_PYTHON, log_dir=tmp_path / "logs")
    result = bisect_step(run, 0, engine="vllm", server=opts, engine_weights=perturb)
    first = result.first_divergence()
    assert (first["layer"], first["op"], first.get("experts")) == (layer, "expert_out", [expert]), first
    assert first["size"] > 1e3 * first["floor"]
    with StepFile(sorted((run / "trace").glob("*.h5"))[0]) as sf:
        sids, off = sf["/samples/sample_id"], sf["/samples/offsets"]
        row = int(np.flatnonzero(sids == result.sample_id)[0])
        routing = sf["/routing/rollout"][int(off[row]):int(off[row + 1]) - 1]
    routed = [int(p) for p in np.flatnonzero((routing[:, layer] == expert).any(-1))]
    assert first["tokens"] and [p for p in first["tokens"] if p < len(routing)] == routed
    before = result.points[:result.points.index(result.first)]
    assert before and not any(p.diverged for p in before)
    # the combined MoE output is captured on vLLM (not derived) and moves with the expert
    moe = next(p for p in result.points if (p.layer, p.op) == (layer, "moe"))
    assert result.how["engine"]["moe"].startswith("captured") and moe.diverged
    assert result.vocab and not any(Path(run / "replay").glob("bisect_step_*_vllm_dump_*"))
