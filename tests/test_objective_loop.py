"""Objectives, corrections, the KL reference, per-tensor gradient norms and the online spike
trigger through the real training loop (`axrl train`) and its trace, then `axrl-debug` on them:
a few short recorded runs on the micro MoE (echo task, rewards vary after the warm-up)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from axrl.trace import TraceReader
from replay import read_dump
from train_util import debug, train

BASE = ["steps=5", "model.preset=micro-moe", "warmup.steps=100", "data.task=echo", "data.task_args={}",
        "data.prompts_per_step=2", "rollout.group_size=4", "checkpoint.every=2", "eval.every=0", "runtime.threads=1",
        "train.lr=1e-4", "train.micro_batch_tokens=120"]
# a grpo2 run with a KL penalty and IcePop; noisy rollout logprobs at step 3 (IcePop masks some of
# those tokens) and an injected lr jump that makes step 2 spike
SPIKY = BASE + ["algo.loss=grpo2", "algo.kl_coef=0.05", "algo.correction.icepop={}",
                "faults.rollout_logprob_noise={step: 3, std: 1.0}", "faults.lr_scale={step: 2, factor: 100}"]
TRIGGER = ["trace.spike_ratio=2", "trace.spike_min_history=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("objective_loop")
    out = {"plain": root / "plain", "trigger": root / "trigger"}
    train(out["plain"], SPIKY)
    train(out["trigger"], SPIKY + TRIGGER)
    return out


def fingerprints(run: Path) -> list[str]:
    reader = TraceReader(run)
    return [str(reader.open(s)["/train/weights_fingerprint_after"]) for s in reader.steps]


def test_trace_records_objective_reference_and_gradient_columns(runs):
    reader = TraceReader(runs["plain"])
    assert reader.config["algo"]["loss"] == "grpo2"
    for s in reader.steps:
        with reader.open(s) as sf:
            lm = sf["/tokens/loss_mask"] != 0
            w, rule = sf["/tokens/is_weight"], sf["/tokens/loss_rule"]
            assert np.isnan(w[~lm]).all() and (rule[~lm] == 0).all()
            assert np.isfinite(w[lm]).all() and ((w[lm] == 0) | (w[lm] > 0)).all()
            # IcePop masks tokens of the noisy step only: weight 0 ⇔ its rule bit
            assert ((w[lm] == 0) == ((rule[lm] & 256) > 0)).all()
            assert (w[lm] == 0).any() == (s == 3)
            ref, old = sf["/tokens/ref_logprob"], sf["/tokens/old_logprob"]
            if s == 0:  # the reference is the policy at RL start: identical bits at step 0
                assert np.array_equal(ref.view(np.uint32), old.view(np.uint32))
            else:
                assert not np.array_equal(ref[lm], old[lm])
            names, norms = list(sf["/train/param_names"]), sf["/train/param_grad_norm"]
            assert norms.shape == (len(sf["/train/updates/grad_norm"]), len(names))
            assert "model.layers.1.mlp.gate.weight" in names
            np.testing.assert_allclose(np.sqrt((norms ** 2).sum(axis=1)), sf["/train/updates/grad_norm"], rtol=1e-5)
            # per update: the share of its loss tokens; weighted by the updates' token counts, the step's
            frac, n = sf["/train/updates/rule_icepop_masked_frac"], sf["/train/updates/num_loss_tokens"]
            assert (frac * n).sum() / n.sum() == pytest.approx(float((w[lm] == 0).mean()), rel=1e-6)
    with reader.open(4) as sf:  # the policy moved away from the reference: a real KL penalty
        assert (sf["/train/updates/kl"] > 0).all() and (sf["/train/updates/kl_loss"] > 0).all()


def test_kl_reference_survives_resume(runs, tmp_path):
    """--resume restores the reference from checkpoint step_000000: the resumed run's reference
    logprobs and weights are the uninterrupted run's, bit for bit."""
    short = tmp_path / "short"
    train(short, [s if not s.startswith("steps=") else "steps=2" for s in SPIKY])
    train(short, SPIKY, "--resume")
    straight = TraceReader(runs["plain"])
    resumed = TraceReader(short)
    for s in (3, 4):
        a, b = straight.open(s)["/tokens/ref_logprob"], resumed.open(s)["/tokens/ref_logprob"]
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert fingerprints(short) == fingerprints(runs["plain"])


def test_spike_trigger_dumps_the_spike_without_changing_training(runs, tmp_path):
    trig = runs["trigger"]
    assert fingerprints(trig) == fingerprints(runs["plain"])  # the trigger only observes
    rows = {r["step"]: r for r in TraceReader(trig).metrics()}
    spiked = [s for s, r in rows.items() if r.get("spike")]
    assert spiked == [2] and rows[2]["spike_dump_verdict"] == "bitwise-equal"
    with TraceReader(trig).open(2) as sf:
        assert sf.attrs["spike"] == 1 and sf.attrs["spike_dump"].endswith("replay/step_000002.h5")
        assert sf.attrs["spike_grad_norm_ratio"] > 2
    online = read_dump(trig / "replay" / "step_000002.h5")
    assert online["attrs"]["source"] == "spike_trigger" and online["attrs"]["verdict"] == "bitwise-equal"
    # `axrl-debug replay --dump` writes the same file from the checkpoint and the trace
    copy = tmp_path / "copy"
    shutil.copytree(trig, copy)
    (copy / "replay" / "step_000002.h5").unlink()
    r = debug("replay", copy, "--step", 2, "--dump", "--json")
    assert r.exit_code == 0, r.output
    offline = read_dump(copy / "replay" / "step_000002.h5")
    assert set(offline) == set(online)
    for key in ("/tokens/loss_contribution", "/tokens/ratio", "/tokens/is_weight", "/tokens/loss_rule",
                "/samples/grad_norm", "/params/grad_norm", "/router/tokens", "/updates/grad_norm"):
        assert np.array_equal(np.asarray(offline[key]), np.asarray(online[key]), equal_nan=True), key
    # spikes attributes the spike to layers and tensors from the per-tensor norms
    doc = json.loads(debug("spikes", trig, "--json", "--metrics", "grad_norm", "--threshold", "3",
                           "--min-history", "2").stdout)
    att = {a["step"]: a for a in doc["attributions"]}
    assert 2 in att and att[2]["source"] == "replay"
    g = att[2]["gradient"]
    assert g["layers"] and g["tensors"] and g["history_steps"] == 2
    assert g["layers"][0]["grad_norm"] >= g["layers"][-1]["grad_norm"]
    assert sum(x["share"] for x in g["layers"]) <= 1 + 1e-9


def test_mismatch_and_summary_report_the_rules(runs):
    r = debug("mismatch", runs["plain"], "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)["objective"]
    rules = {x["rule"]: x for x in obj["rules"]}
    assert obj["tokens"] > 0 and rules["icepop_masked"]["tokens"] > 0
    assert obj["masked_frac"] == pytest.approx(rules["icepop_masked"]["frac"])
    text = " ".join(debug("mismatch", runs["plain"]).stdout.split())
    assert "objective and corrections over" in text and "icepop_masked" in text
    doc = json.loads(debug("summary", runs["plain"], "--json").stdout)
    assert [0 < row["masked_frac"] < 1 for row in doc["steps"]] == [s == 3 for s in range(5)]
    assert all("rule_clip_high_frac" in row for row in doc["steps"])
    assert "masked" in debug("summary", runs["plain"]).stdout


def test_what_if_objectives_and_sweep(runs):
    r = debug("replay", runs["plain"], "--step", 2, "--variant", "algo.loss=cispo", "--variant",
              "algo.loss=gspo algo.clip_low=0.0003 algo.clip_high=0.0004", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    base, (cispo, gspo) = doc["baseline"], doc["variants"]
    assert all("update_norm" in u and u["update_norm"] > 0 for u in base + cispo["updates"] + gspo["updates"])
    # update 0 is on-policy (r = 1: grpo2 and cispo are the same REINFORCE); after the 100× lr
    # update the ratios move and the objectives part
    assert cispo["updates"][0]["grad_norm"] == base[0]["grad_norm"]
    assert cispo["updates"][1]["grad_norm"] != base[1]["grad_norm"]
    assert gspo["updates"][1]["clipfrac"] > base[1]["clipfrac"]
    # the sweep ranks the mitigation family by the largest update grad norm it leaves
    r = debug("replay", runs["plain"], "--step", 2, "--sweep", "--json")
    assert r.exit_code == 0, r.output
    sweep = json.loads(r.stdout)["sweep"]
    labels = [x["label"] for x in sweep["ranking"]]
    assert sweep["family"] == "mitigations" and len(labels) >= 7
    assert "r3=true r3_scope={loss_tokens_only: true}" in labels and "algo.advantage_balance=true" in labels
    norms = [x["grad_norm"] for x in sweep["ranking"]]
    assert norms == sorted(norms) and [x["rank"] for x in sweep["ranking"]] == list(range(1, len(norms) + 1))
    r = debug("replay", runs["plain"], "--step", 2, "--sweep", "--family", "tis_cap")
    assert r.exit_code == 0 and "sweep 'tis_cap' at step 2" in " ".join(r.stdout.split())
    bad = debug("replay", runs["plain"], "--step", 2, "--sweep", "--family", "nope")
    assert bad.exit_code == 2 and "unknown sweep family" in bad.output
