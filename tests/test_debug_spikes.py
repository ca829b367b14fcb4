"""Spike detection (rolling median/MAD) and attribution (loss proxy, replay dump, importance weights)."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pandas as pd
import pytest

from axrl.trace import TraceReader
from axrl_debug.analysis.spikes import SpikeConfig, attribute, detect, loss_proxy, robust_z
from axrl_debug.synthetic import TinySample, TinyToken, gen, tiny_record, write_run


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
                       "reward": [0.5, 0.52, 0.48, 0.5, 0.51, 0.49, 0.5, 0.5, 0.5, 0.5, -3.0, 0.5]})
    out, spikes = detect(df, SpikeConfig(metrics=("loss", "reward"), window=6, threshold=5))
    assert [(s["step"], s["metric"], s["direction"]) for s in spikes] == [(7, "loss", "up"), (10, "reward", "down")]
    assert out.loc[7, "spikes"] == "loss" and out.loc[10, "spikes"] == "reward" and out.loc[8, "spikes"] == ""
    # the spike at 7 is inside step 8's window but barely moves the median: 8 is not flagged
    assert abs(out.loc[8, "loss_z"]) < 5


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
    assert [s["sample"] for s in a["samples_by_loss"]] == [1, 0, 2]
    s1 = a["samples_by_loss"][0]
    assert s1["loss_contribution"] == pytest.approx(1.0) and s1["loss_share"] == pytest.approx(0.5)
    assert s1["policy_versions"] == [0] and s1["max_version_lag"] == 1 and s1["num_turns"] == 1
    assert [t["token"] for t in a["tokens_by_loss"]][:1] == [4]
    # importance weights: sample 1's Δ = 0.7 dominates; token ranking by |Δ|: 0.7, 0.05, 0.02
    assert a["samples_by_weight"][0]["sample"] == 1
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
    assert a["samples_by_loss"][0]["sample"] == 2
