"""`axrl-debug bisect --engine sglang` against a REAL SGLang server (`pytest -m sglang`; skipped
without AXRL_SGLANG_PYTHON, see tests/test_sglang_real.py): one expert's weights perturbed in the
served copy only are named with their layer, `expert_out`, the expert and the positions SGLang
routed to it, every point before it within its floor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bisect_util import EXPERT, perturbed_expert, routed_positions, small_run
from replay.bisect import bisect_step
from replay.server_rescore import ServerOptions

SGLANG_PYTHON = os.environ.get("AXRL_SGLANG_PYTHON", "")


@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PYTHON, reason="real-SGLang suite: set AXRL_SGLANG_PYTHON (scripts/sglang-cpu-env.sh)")
def test_expert_perturbed_in_the_served_copy_is_named_on_sglang(tmp_path):
    from train_util import train

    run = tmp_path / "run"
    train(run, small_run("micro-moe"))
    layer, expert = EXPERT
    opts = ServerOptions(python=SGLANG_PYTHON, cpu_compat=True, log_dir=tmp_path / "logs")
    result = bisect_step(run, 0, engine="sglang", server=opts, engine_weights=perturbed_expert(layer, expert))
    first = result.first_divergence()
    assert (first["layer"], first["op"], first.get("experts")) == (layer, "expert_out", [expert]), first
    assert first["size"] > 1e3 * first["floor"]
    # the positions the recorded routing sent to that expert (SGLang agrees on every choice), plus
    # the last token, which SGLang's prefill routes too (the engine never fed it)
    ids = next(p for p in result.points if (p.layer, p.op) == (layer, "topk_ids"))
    assert ids.over == []
    routed, fed = routed_positions(run, result.sample_id, layer, expert)
    assert first["tokens"] and [p for p in first["tokens"] if p < fed] == routed
    before = result.points[:result.points.index(result.first)]
    assert before and not any(p.diverged for p in before)
    assert result.vocab and result.how["engine"]["attn"].startswith("captured")
    assert not any(Path(run / "replay").glob("bisect_step_*_sglang_dump_*")), "the dump folder was left behind"
    assert result.timings["server_start_seconds"] > 0
