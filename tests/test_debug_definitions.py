"""One definition of each per-token quantity (axrl/trace/quantities.py): the training loop's logged
headline mismatch, the analysis's numpy path and its compiled path select the same analysed tokens,
compute the same Δ and report the same mean |Δ|; the compiled per-token keys are held to the numpy
definitions on random steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from axrl.runtime.recording.builders import mismatch as recorder_mismatch
from axrl.trace import TraceReader
from axrl.trace.quantities import analysed_mask, delta, mean_abs_delta, split_deltas, split_mask
from axrl_debug.analysis.mismatch import MismatchAccumulator, MismatchConfig, mismatch_report, step_tokens
from axrl_debug.synthetic import TinySample, TinyToken, tiny_record, write_run


def random_columns(rng: np.random.Generator, t: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """One step's core columns with every case the selection must get right: prompt tokens (no
    rollout logprob), generated tokens without one, and non-finite trainer logprobs."""
    lm = (rng.random(t) < 0.7).astype(np.uint8)
    rollout = np.where(lm == 1, -rng.exponential(1.0, t), np.nan)
    rollout[rng.random(t) < 0.05] = np.nan                       # the engine returned none
    old = rollout + rng.normal(0, 0.05, t)
    old[lm == 0] = rng.normal(-3, 1, int((lm == 0).sum()))       # trainer recompute of prompt tokens
    bad = rng.random(t) < 0.05
    old[bad] = rng.choice([np.nan, np.inf, -np.inf], int(bad.sum()))
    return {"/tokens/loss_mask": lm, "/tokens/rollout_logprob": rollout.astype(dtype),
            "/tokens/old_logprob": old.astype(dtype)}


def test_definitions_by_hand():
    lm = np.array([1, 1, 0, 1, 1, 1], np.uint8)
    r = np.array([-1.0, np.nan, -2.0, -0.5, -0.25, -3.0], np.float32)
    o = np.array([-1.5, -1.0, -1.0, np.inf, -0.5, -2.0], np.float32)
    assert analysed_mask(lm, r, o).tolist() == [True, False, False, False, True, True]
    assert mean_abs_delta(lm, r, o) == pytest.approx((0.5 + 0.25 + 1.0) / 3, rel=1e-12)
    assert math.isnan(mean_abs_delta(np.zeros(6, np.uint8), r, o))
    b = np.array([-1.25, np.nan, np.nan, -0.5, np.nan, -2.0], np.float32)
    assert split_mask(lm, r, o, b).tolist() == [True, False, False, False, False, True]
    engine, stale = split_deltas(r, o, b)
    assert engine[0] == -0.25 and stale[0] == -0.25 and engine[5] == 1.0 and stale[5] == 0.0
    keep = split_mask(lm, r, o, b)
    assert np.array_equal(engine[keep] + stale[keep], delta(r, o)[keep])


@pytest.mark.parametrize("compiled", [False, True])
def test_logged_and_analysed_headline_mismatch_are_one_number(tmp_path, monkeypatch, compiled):
    """metrics.jsonl's ``mismatch`` (the recorder, on the loop's torch tensors) and the analysis's
    ``mean_abs`` of the written step, per step and pooled, on data with every excluded case."""
    from axrl_debug.analysis import mismatch

    monkeypatch.setattr(mismatch, "COMPILED_MIN_BYTES", 0 if compiled else 1 << 62)
    rng = np.random.default_rng(7)
    records, logged, cols_by_step = [], [], []
    for step in range(3):
        cols = random_columns(rng, 900)
        lm, r, o = cols["/tokens/loss_mask"], cols["/tokens/rollout_logprob"], cols["/tokens/old_logprob"]
        samples = [TinySample([TinyToken(loss_mask=int(lm[i]), turn=1, version=step, rollout=float(r[i]),
                                         old=float(o[i])) for i in range(a, a + 300)]) for a in (0, 300, 600)]
        records.append(tiny_record(step, step, samples, routing=False))
        logged.append(recorder_mismatch(torch.from_numpy(o), torch.from_numpy(r), torch.from_numpy(lm)))
        cols_by_step.append(cols)
    write_run(tmp_path / "run", records)
    res, _ = mismatch_report(TraceReader(tmp_path / "run"), None, MismatchConfig(top_k=0), context=False)
    exact = (lambda v: v) if not compiled else (lambda v: pytest.approx(v, rel=1e-12))
    for step, cols in enumerate(cols_by_step):
        lm, r, o = cols["/tokens/loss_mask"], cols["/tokens/rollout_logprob"], cols["/tokens/old_logprob"]
        by_hand = [abs(float(o[i]) - float(r[i])) for i in range(len(lm))
                   if lm[i] and math.isfinite(r[i]) and math.isfinite(o[i])]
        assert logged[step] == mean_abs_delta(lm, r, o) == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-12)
        assert res["per_step"][step]["analysed"] == len(by_hand)
        assert res["per_step"][step]["mean_abs"] == exact(logged[step])
    pooled = [np.concatenate([c[k] for c in cols_by_step]) for k in
              ("/tokens/loss_mask", "/tokens/rollout_logprob", "/tokens/old_logprob")]
    assert res["metrics"]["mean_abs"] == pytest.approx(mean_abs_delta(*pooled), rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_selection_is_the_analysed_mask(dtype):
    from axrl_debug.analysis.mismatch import kernels

    rng = np.random.default_rng(3)
    for t in (0, 1, 17, 5000):
        cols = random_columns(rng, t, dtype)
        lm, r, o = cols["/tokens/loss_mask"], cols["/tokens/rollout_logprob"], cols["/tokens/old_logprob"]
        idx, d = np.empty(t, np.int64), np.empty(t, np.float64)
        rr, oo = np.empty(t, dtype), np.empty(t, dtype)
        none = np.zeros(1, np.int64)
        n, gen, *_ = kernels.select_analysed(lm, r, o, none, none, False, idx, d, rr, oo)
        want = np.flatnonzero(analysed_mask(lm, r, o))
        assert gen == int(np.count_nonzero(lm))
        assert np.array_equal(idx[:n], want)
        assert np.array_equal(d[:n], delta(r[want], o[want]))      # bit for bit


def random_step(rng: np.random.Generator, n_samples: int, policy_version: int) -> dict[str, np.ndarray]:
    """A multi-turn step: prompts, two assistant turns around a tool output, tokens of several
    versions, float16 entropies (some non-finite), MoE routing and a behaviour_train logprob."""
    lengths = rng.integers(1, 80, n_samples)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    t = int(off[-1])
    cols = random_columns(rng, t)
    sample_of = np.repeat(np.arange(n_samples), lengths)
    pos = np.arange(t) - off[:-1][sample_of]
    turn = np.minimum(pos // 20, 3).astype(np.int16)
    cols["/tokens/loss_mask"][turn == 2] = 0                     # a tool output
    version = policy_version - rng.integers(0, 4, n_samples)[sample_of]
    ent = rng.gamma(1.0, 1.0, t).astype(np.float16)
    ent[rng.random(t) < 0.02] = np.inf
    experts = np.argsort(rng.random((t, 2, 6)), axis=2)[:, :, :2].astype(np.uint8)
    train = experts.copy()
    moved = rng.random((t, 2)) < 0.2
    train[moved] = np.argsort(rng.random((int(moved.sum()), 6)), axis=1)[:, :2]
    behaviour = cols["/tokens/old_logprob"] - np.where(version < policy_version, 0.1, 0.0)
    behaviour[rng.random(t) < 0.1] = np.nan
    cols.update({"/samples/offsets": off, "/tokens/turn": turn, "/tokens/policy_version": version.astype(np.int32),
                 "/tokens/entropy": ent, "/routing/rollout": experts, "/routing/train": train,
                 "/routing/rollout_valid": (rng.random(t) < 0.9).astype(np.uint8),
                 "/tokens/behaviour_train_logprob": behaviour.astype(np.float32)})
    return cols


def flat(doc, prefix=""):
    """Nested dicts / lists as one flat {path: value} (pytest.approx compares flat mappings)."""
    if isinstance(doc, dict):
        return {k: v for key, sub in doc.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, sub in enumerate(doc) for k, v in flat(sub, f"{prefix}/{i}").items()}
    return {prefix: doc}


def test_compiled_keys_are_the_numpy_definitions_on_random_steps():
    """Every breakdown (position in the response segment, rollout prob, entropy, turn, version lag,
    routing of the predicting row), the Δ split and the worst tokens' fields: the compiled pass
    gives what the numpy definitions give, on steps cut into blocks of whole samples."""
    rng = np.random.default_rng(11)
    cfg = MismatchConfig(top_k=25)
    for trial in range(6):
        steps = [(s, 10 + s, random_step(rng, int(rng.integers(1, 60)), 10 + s)) for s in range(3)]
        compiled, numpy_path = MismatchAccumulator(cfg), MismatchAccumulator(cfg)
        compiled._block_tokens = [1, 50, 1 << 20][trial % 3]
        for step, pv, cols in steps:
            compiled.add_columns(step, pv, cols)
            numpy_path.add(step_tokens(step, pv, cols, cfg))
        a, b = compiled.result(), numpy_path.result()
        assert flat(a) == pytest.approx(flat(b), rel=1e-12, nan_ok=True)
        assert len(a["top"]) == 25 and "delta_split" in a and a["delta_split"]["tokens"] > 0
