"""Spike detection (rolling median/MAD) and attribution (loss proxy, replay dump, importance weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from axrl.trace import TraceReader
from axrl_debug.analysis.spikes import SpikeConfig, attribute, detect, loss_proxy, robust_z
from axrl_debug.synthetic import TinySample, TinyToken, gen, tiny_record, write_run
from train_util import ROOT, debug, train


def test_robust_z_by_hand():
    # window 4 before index 4: [1, 2, 3, 4] → median 2.5, MAD median(|·−2.5|) = 1 → scale 1.4826
    x = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    med, scale, z = robust_z(x, SpikeConfig(window=4, min_history=3, rel_floor=0.0))
    assert np.isnan(z[:3]).all()                          # fewer than 3 values before them
    assert med[3] == 2.0 and scale[3] == pytest.approx(1.4826 * 1.0)   # [1,2,3]: median 2, MAD 1
    assert med[4] == 2.5 and scale[4] == pytest.approx(1.4826)
    assert z[4] == pytest.approx((10 - 2.5) / 1.4826)


def test_flat_history_uses_the_relative_floor():
    x = np.array([2.0, 2.0, 2.0, 2.0, 2.4, 3.5])
    _, scale, z = robust_z(x, SpikeConfig(window=4, rel_floor=0.1))
    assert scale[4] == pytest.approx(0.2)                 # MAD 0 → 0.1 · |median 2|
    assert z[4] == pytest.approx(2.0) and z[5] == pytest.approx((3.5 - 2.0) / 0.2)


def test_detect_flags_up_and_down():
    df = pd.DataFrame({"step": range(12),
                       "loss": [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 9.0, 1.0, 1.02, 0.98, 1.0],
                       "reward": [0.5, 0.52, 0.48, 0.5, 0.51, 0.49, 0.5, 0.5, 0.5, 0.5, -3.0, 0.5],
                       "advantage_abs_mean": [0.8] * 12})
    out, spikes = detect(df, SpikeConfig(metrics=("loss", "reward"), window=6, threshold=5))
    assert [(s["step"], s["metric"], s["direction"]) for s in spikes] == [(7, "loss", "up"), (10, "reward", "down")]
    assert out.loc[7, "spikes"] == "loss" and out.loc[10, "spikes"] == "reward" and out.loc[8, "spikes"] == ""
    # the spike at 7 is inside step 8's window but barely moves the median: 8 is not flagged
    assert abs(out.loc[8, "loss_z"]) < 5


QUICKSTART_STEPS = Path(__file__).parent / "data" / "quickstart_steps.json"


def test_healthy_quickstart_has_no_spikes():
    """The real 40-step quickstart (tests/data/quickstart_steps.json): its loss moves by ±3.5e-4
    around 0, its mismatch is fp32 rounding (up to 1.1e-7, about 1 ulp) and its grad norm jumps with
    z up to 5.5 but never past 2.7× its trailing median, so a z-score alone flags 5 "spikes"; none
    is large in the quantity's own units."""
    doc = json.loads(QUICKSTART_STEPS.read_text())
    df = pd.DataFrame(doc["steps"])
    cfg = SpikeConfig.for_run({"model": {"dtype": doc["model_dtype"]}})
    assert detect(df, cfg)[1] == []
    # what the z-score alone says about the same steps (the floors switched off)
    loose = SpikeConfig(min_ratio=1.0, rounding_ulps=0.0, loss_floor=0.0, min_history=3)
    assert {(s["step"], s["metric"]) for s in detect(df, loose)[1]} >= {(3, "grad_norm"), (26, "grad_norm"),
                                                                        (28, "mismatch"), (31, "loss")}


def test_each_floor_is_what_stops_the_noise():
    steps = range(12)
    base = {"step": steps, "advantage_abs_mean": [0.5] * 12}
    # loss: a z = 13 wiggle of 5e-4 around 0 is 0.1 % of E|A| = 0.5; 0.05 (10 %) is a spike
    loss = [1e-5, -2e-5, 3e-5, -1e-5, 2e-5, 0.0, -3e-5, 1e-5, 5e-4, 0.0, 0.05, 0.0]
    found = detect(pd.DataFrame({**base, "loss": loss}), SpikeConfig(metrics=("loss",)))[1]
    assert [s["step"] for s in found] == [10]
    # without the advantage scale (metrics.jsonl only) the loss is never flagged
    assert detect(pd.DataFrame({"step": steps, "loss": loss}), SpikeConfig(metrics=("loss",)))[1] == []
    # grad norm: 2.5× the baseline is unusual (z > 5) but not 3×; 4× is a spike
    g = [0.50, 0.51, 0.49, 0.50, 0.52, 0.48, 0.50, 1.25, 0.50, 0.51, 2.0, 0.5]
    found = detect(pd.DataFrame({**base, "grad_norm": g}), SpikeConfig(metrics=("grad_norm",)))[1]
    assert [s["step"] for s in found] == [10]
    # mismatch: 10× the baseline but 0.8 ulp of fp32 is rounding; 10 ulps is not
    eps = 2.0 ** -23
    m = [1e-8, 1.1e-8, 0.9e-8, 1e-8, 1e-8, 1.05e-8, 1e-8, 1e-7, 1e-8, 1e-8, 10 * eps, 1e-8]
    cfg = SpikeConfig(metrics=("mismatch",))
    assert [s["step"] for s in detect(pd.DataFrame({**base, "mismatch": m}), cfg)[1]] == [10]
    # in a bf16 run the floor is 4 ulps of bf16 (0.031): the same 1.2e-6 is rounding there
    assert detect(pd.DataFrame({**base, "mismatch": m}), SpikeConfig.for_run({"model": {"dtype": "bfloat16"}},
                                                                             metrics=("mismatch",)))[1] == []


def test_spike_lr_example_still_shows_its_spike(tmp_path):
    """examples/spike_lr.yaml for real (~25 s): the 50× learning rate of step 8 shows as the reward
    collapse of step 9 and a grad-norm spike right after it (step 9 or 10: the exact step depends
    on the CPU's kernels, docs/debugging.md), and nothing is flagged before the fault (step 8's
    own updates move the loss past the threshold on some CPUs, z 4-6: step 8 or 9 comes first)."""
    run = tmp_path / "spike"
    train(run, config=ROOT / "examples" / "spike_lr.yaml")
    result = debug("spikes", run, "--json")
    assert result.exit_code == 0, result.output
    found = {(s["step"], s["metric"]) for s in json.loads(result.stdout)["spikes"]}
    assert (9, "reward") in found
    assert {(9, "grad_norm"), (10, "grad_norm")} & found
    assert min(step for step, _ in found) in (8, 9)


def attribution_run(path, loss_agg="seq-mean-token-mean", tis=False):
    """Step 0: three samples in two updates ([0, 1] then [2]).

    sample 0: 2 loss tokens, A = +1      sample 1: 1 loss token, A = −2     sample 2: 3 loss tokens, A = +0.5
    seq-mean-token-mean, no TIS: c_t = −A / (S_u · n_i)
      update 0 (S = 2): sample 0 tokens −1/(2·2) = −0.25 each; sample 1 token +2/(2·1) = +1
      update 1 (S = 1): sample 2 tokens −0.5/(1·3) each
    """
    s0 = TinySample([TinyToken(id=1), gen(0.5, 0.01, advantage=1.0, id=2), gen(0.5, -0.02, advantage=1.0, id=3)],
                    reward=1.0, num_turns=1)
    s1 = TinySample([TinyToken(id=4), gen(0.4, 0.7, advantage=-2.0, version=0, id=5)], reward=0.0)
    s2 = TinySample([TinyToken(id=6), gen(0.3, 0.0, advantage=0.5, turn=1, id=7),
                     gen(0.3, 0.0, advantage=0.5, turn=2, id=8), gen(0.3, 0.05, advantage=0.5, turn=2, id=9)],
                    reward=0.5, num_turns=2)
    rec = tiny_record(0, 1, [s0, s1, s2], updates=[[0, 1], [2]])
    cfg = {"algo": {"clip_low": 0.2, "clip_high": 0.28, "tis": tis, "tis_cap": 2.0, "loss_agg": loss_agg}}
    write_run(path, [rec], config=cfg)
    return TraceReader(path)


def test_loss_proxy_by_hand(tmp_path):
    reader = attribution_run(tmp_path / "run")
    with reader.open(0) as sf:
        cols = {k: sf[k] for k in sf.keys()}
    c = loss_proxy(cols, reader.config["algo"])
    expected = [0, -0.25, -0.25, 0, 1.0, 0, -0.5 / 3, -0.5 / 3, -0.5 / 3]
    assert c.tolist() == pytest.approx(expected)
    # token-mean: update 0 has M = 3 loss tokens, update 1 has M = 3
    c = loss_proxy(cols, {"loss_agg": "token-mean", "tis": False})
    assert c.tolist() == pytest.approx([0, -1 / 3, -1 / 3, 0, 2 / 3, 0, -0.5 / 3, -0.5 / 3, -0.5 / 3])
    # TIS on: sample 1's token is weighted by min(exp(0.7), 2) = 2 (capped)
    c = loss_proxy(cols, {"loss_agg": "seq-mean-token-sum", "tis": True, "tis_cap": 2.0})
    assert c[4] == pytest.approx(2.0 * 2.0 / 2)
    assert c[1] == pytest.approx(-math.exp(float(cols["/tokens/old_logprob"][1]) - float(cols["/tokens/rollout_logprob"][1])) / 2)


def test_attribution_ranks_samples_tokens_and_weights(tmp_path):
    reader = attribution_run(tmp_path / "run")
    a = attribute(reader, 0, top=3)
    assert a["source"] == "proxy" and a["replay_dump"] is None
    # |contributions|: sample 1 → 1.0, sample 0 → 0.5, sample 2 → 0.5 (tie broken by row)
    assert [s["row"] for s in a["samples_by_loss"]] == [1, 0, 2]
    s1 = a["samples_by_loss"][0]
    assert s1["loss_contribution"] == pytest.approx(1.0) and s1["loss_share"] == pytest.approx(0.5)
    assert s1["policy_versions"] == [0] and s1["max_version_lag"] == 1 and s1["num_turns"] == 1
    assert [t["token"] for t in a["tokens_by_loss"]][:1] == [4]
    # importance weights: sample 1's Δ = 0.7 dominates; token ranking by |Δ|: 0.7, 0.05, 0.02
    assert a["samples_by_weight"][0]["row"] == 1
    assert [t["token"] for t in a["tokens_by_weight"]] == [4, 8, 2]
    assert a["tokens_by_weight"][1]["turn"] == 2 and a["tokens_by_weight"][1]["position"] == 3


def test_replay_dump_replaces_the_proxy(tmp_path):
    reader = attribution_run(tmp_path / "run")
    (tmp_path / "run" / "replay").mkdir()
    with h5py.File(tmp_path / "run" / "replay" / "step_000000.h5", "w") as f:
        contrib = np.zeros((2, 9))                         # [U, T]: summed over updates
        contrib[0, 7] = 3.0
        contrib[1, 7] = 1.0
        contrib[0, 1] = -0.5
        f["/tokens/loss_contribution"] = contrib
        f["/tokens/ratio"] = np.linspace(0.9, 1.1, 9)
    a = attribute(reader, 0, top=2)
    assert a["source"] == "replay" and a["replay_dump"].endswith("step_000000.h5")
    top = a["tokens_by_loss"][0]
    assert top["token"] == 7 and top["loss_contribution"] == pytest.approx(4.0)
    assert top["ratio"] == pytest.approx(np.linspace(0.9, 1.1, 9)[7])
    assert a["samples_by_loss"][0]["row"] == 2


def test_a_split_trace_watches_the_engine_part_of_the_mismatch():
    """Async runs: the total mismatch moves with policy drift (staleness); only the engine part
    can flag a mismatch spike."""
    n = 20
    engine = np.full(n, 4e-8) * (1 + 0.1 * np.sin(np.arange(n)))
    stale = np.full(n, 1e-3) * (1 + 0.1 * np.cos(np.arange(n)))
    stale[12] = 2e-2                    # the policy moved a lot in one step: not an engine problem
    engine[16] = 5e-5                   # an engine that suddenly disagrees
    df = pd.DataFrame({"step": np.arange(n), "mismatch": engine + stale, "mismatch_engine": engine,
                       "mismatch_staleness": stale})
    _, spikes = detect(df, SpikeConfig(metrics=("mismatch",)))
    assert [(s["step"], s["metric"]) for s in spikes] == [(16, "mismatch_engine")]
    _, spikes = detect(df.drop(columns=["mismatch_engine", "mismatch_staleness"]), SpikeConfig(metrics=("mismatch",)))
    assert 12 in [s["step"] for s in spikes]  # without the split, drift looks like a mismatch spike
