"""Mismatch metrics and breakdowns on tiny hand-made traces, against hand-computed expectations.

The reference values are computed per token with plain Python ``math`` from the float32 values
that were actually stored (so rounding of the stored logprobs is accounted for), plus literal
numbers (counts, shares, agreement fractions) worked out by hand in the comments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from axrl.trace import TraceReader
from axrl_debug.analysis.mismatch import (ENTROPY_LABELS, POSITION_LABELS, PROB_LABELS, MismatchConfig,
                                          mismatch_report, routing_agreement)
from axrl_debug.synthetic import NAN, TinySample, TinyToken, gen, tiny_record, write_run

CONFIG = {"algo": {"clip_low": 0.2, "clip_high": 0.28, "tis": True, "tis_cap": 1.2, "loss_agg": "token-mean"}}


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def analysis_path(request, monkeypatch):
    """Every test runs on both paths of the analysis: the compiled passes (kernels.py, chosen for
    large traces) and the numpy per-token path (small ones); they must give the same answers."""
    from axrl_debug.analysis import mismatch

    monkeypatch.setattr(mismatch, "COMPILED_MIN_BYTES", 0 if request.param == "compiled" else 1 << 62)
    return request.param
A, B = [0, 1], [2, 3]


def step0_samples() -> list[TinySample]:
    """Step 0, policy_version 3. Analysed tokens (loss_mask 1, finite logprobs): t2 t3 t5 t8 t9.

    t  sample turn ver  role          rollout p  Δ      entropy  routing row (as input)
    0  0      0    -1   prompt                                    agrees
    1  0      0    -1   prompt                                    agrees, train order swapped
    2  0      1     3   gen pos 0     0.8        +0.1   0.05     rollout_valid = 0
    3  0      1     3   gen pos 1     0.7        −0.2   0.3      agrees
    4  0      1    -1   tool output                               layer 1 differs entirely
    5  0      2     2   gen pos 0     0.05       +0.3   1.5      agrees
    6  0      2     2   gen, no rollout logprob (excluded)        last of sample: invalid
    7  1      0    -1   prompt                                    agrees
    8  1      1     3   gen pos 0     0.995       0.0   0.005    layer 0 shares one expert
    9  1      1     3   gen pos 1     0.2        −0.25  3.0      last of sample: invalid
    """
    s0 = TinySample([
        TinyToken(id=11, route=[A, A]),
        TinyToken(id=12, route=[[0, 1], [2, 3]], train_route=[[1, 0], [3, 2]]),
        gen(0.8, 0.1, turn=1, version=3, entropy=0.05, id=13, route_valid=0),
        gen(0.7, -0.2, turn=1, version=3, entropy=0.3, id=14),
        TinyToken(id=15, turn=1, route=[A, A], train_route=[A, B]),
        gen(0.05, 0.3, turn=2, version=2, entropy=1.5, id=16),
        TinyToken(id=17, loss_mask=1, turn=2, version=2, rollout=NAN, old=-0.5, route_valid=0),
    ], reward=1.0, prompt_len=2, num_turns=2)
    s1 = TinySample([
        TinyToken(id=21),
        gen(0.995, 0.0, turn=1, version=3, entropy=0.005, id=22, route=[[0, 1], A], train_route=[[1, 2], A]),
        gen(0.2, -0.25, turn=1, version=3, entropy=3.0, id=23, route_valid=0),
    ], reward=0.0, prompt_len=1, num_turns=1)
    return [s0, s1]


def step1_samples() -> list[TinySample]:
    """Step 1, policy_version 4: one sample, two analysed tokens (Δ = +0.5 and −0.05)."""
    return [TinySample([TinyToken(id=31), gen(0.3, 0.5, version=4, id=32), gen(0.6, -0.05, version=3, id=33),
                        TinyToken(id=34, route_valid=0)], prompt_len=1)]


@pytest.fixture()
def run(tmp_path):
    write_run(tmp_path / "run", [tiny_record(0, 3, step0_samples()), tiny_record(1, 4, step1_samples())],
              config=CONFIG)
    return TraceReader(tmp_path / "run")


def stored(reader: TraceReader, step: int) -> list[dict]:
    """The analysed tokens as the reference sees them: float64 of the stored float32 values."""
    with reader.open(step) as sf:
        lm, r, o = sf["/tokens/loss_mask"], sf["/tokens/rollout_logprob"], sf["/tokens/old_logprob"]
        out = []
        for t in range(len(lm)):
            if lm[t] == 1 and math.isfinite(r[t]) and math.isfinite(o[t]):
                out.append({"t": t, "r": float(r[t]), "o": float(o[t]), "d": float(o[t]) - float(r[t])})
        return out


def reference(tokens: list[dict], clip_low=0.2, clip_high=0.28, tis_cap=1.2) -> dict[str, float]:
    """Every headline metric, token by token, straight from its definition."""
    n = len(tokens)
    d = [x["d"] for x in tokens]
    rho = [math.exp(x) for x in d]
    ad = sorted(abs(x) for x in d)

    def pct(q):  # numpy's default (linear) percentile
        pos = q / 100 * (n - 1)
        lo = math.floor(pos)
        return ad[lo] + (ad[min(lo + 1, n - 1)] - ad[lo]) * (pos - lo)

    px = [math.exp(x["r"]) for x in tokens]
    py = [math.exp(x["o"]) for x in tokens]
    mx, my = sum(px) / n, sum(py) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(px, py))
    vx = sum((a - mx) ** 2 for a in px)
    vy = sum((b - my) ** 2 for b in py)
    mean_rho = sum(rho) / n
    return {
        "mean_abs": sum(ad) / n, "max_abs": max(ad), "p50_abs": pct(50), "p99_abs": pct(99),
        "mean": sum(d) / n, "k1": -sum(d) / n, "k2": sum(x * x / 2 for x in d) / n,
        "k3": sum(math.exp(x) - 1 - x for x in d) / n, "chi2": sum((p - 1) ** 2 for p in rho) / n,
        "token_mult_prob_error": sum(math.exp(abs(x)) for x in d) / n,
        "ratio_mean": mean_rho, "ratio_std": math.sqrt(sum((p - mean_rho) ** 2 for p in rho) / n),
        "ratio_min": min(rho), "ratio_max": max(rho),
        "frac_outside_clip": sum(p < 1 - clip_low or p > 1 + clip_high for p in rho) / n,
        "frac_above_clip_high": sum(p > 1 + clip_high for p in rho) / n,
        "frac_below_clip_low": sum(p < 1 - clip_low for p in rho) / n,
        "frac_above_tis_cap": sum(p > tis_cap for p in rho) / n,
        "ess": sum(rho) ** 2 / (n * sum(p * p for p in rho)),
        "pearson_prob": cov / math.sqrt(vx * vy),
    }


def report(reader, steps, **kw):
    cfg = MismatchConfig.from_run_config(reader.config, **kw)
    res, _ = mismatch_report(reader, steps, cfg)
    return res


def test_headline_metrics_match_definitions(run):
    res = report(run, [0])
    toks = stored(run, 0)
    assert [x["t"] for x in toks] == [2, 3, 5, 8, 9]
    assert res["tokens"] == {"total": 10, "generated": 6, "analysed": 5}
    assert res["thresholds"] == {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 1.2}
    ref = reference(toks)
    for key, value in ref.items():
        # p50/p99 are taken over float32-stored |Δ| (7 significant digits)
        assert res["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    m = res["metrics"]
    # by hand: |Δ| = {0.1, 0.2, 0.3, 0, 0.25} → mean 0.17, median 0.2; ρ = e^0.3 = 1.35 is above the
    # band's 1.28 and the TIS cap 1.2; ρ = e^−0.25 = 0.78 is below 0.8
    assert m["mean_abs"] == pytest.approx(0.17, abs=1e-6)
    assert m["p50_abs"] == pytest.approx(0.2, abs=1e-6)
    assert m["max_abs"] == pytest.approx(0.3, abs=1e-6)
    assert m["frac_above_clip_high"] == 0.2 and m["frac_below_clip_low"] == 0.2
    assert m["frac_outside_clip"] == 0.4 and m["frac_above_tis_cap"] == 0.2
    assert m["k1"] == pytest.approx(-(0.1 - 0.2 + 0.3 + 0 - 0.25) / 5, abs=1e-6)
    assert m["k3"] > 0 and m["k2"] > 0 and 0 < m["ess"] <= 1


def test_tiny_mismatch_keeps_precision():
    """Δ ≈ 1e-7 (the real CPU mismatch): k3 = expm1(Δ) − Δ ≈ Δ²/2 must not cancel to 0 or noise."""
    from axrl_debug.analysis.mismatch import MismatchAccumulator, StepTokens

    d = np.array([1e-7, -2e-7, 3e-7])
    st = StepTokens(step=0, policy_version=0, num_tokens=3, num_generated=3, idx=np.arange(3), delta=d,
                    rollout_lp=np.full(3, -1.0), old_lp=-1.0 + d, offsets=np.array([0, 3]))
    acc = MismatchAccumulator(MismatchConfig(breakdowns=False, routing=False, top_k=0))
    acc.add(st)
    m = acc.result()["metrics"]
    assert m["k3"] == pytest.approx(np.mean(d ** 2 / 2), rel=1e-6)
    assert m["chi2"] == pytest.approx(np.mean(np.expm1(d) ** 2), rel=1e-9)
    assert m["ratio_std"] == pytest.approx(np.std(np.exp(d)), rel=1e-6)


def rows(res, name):
    return {r["bucket"]: r for r in res["breakdowns"][name]}


def test_breakdowns(run):
    res = report(run, [0])
    toks = {x["t"]: abs(x["d"]) for x in stored(run, 0)}
    total = sum(toks.values())

    def check(name, bucket, ts):
        r = rows(res, name)[bucket]
        assert r["count"] == len(ts), (name, bucket)
        assert r["mean_abs"] == pytest.approx(sum(toks[t] for t in ts) / len(ts), rel=1e-9)
        assert r["abs_share"] == pytest.approx(sum(toks[t] for t in ts) / total, rel=1e-9)

    # position inside the response segment: t2, t5, t8 open a segment; t3 and t9 follow one
    check("position", "0 (first)", [2, 5, 8])
    check("position", "1", [3, 9])
    assert [r["bucket"] for r in res["breakdowns"]["position"]] == POSITION_LABELS
    assert sum(r["count"] for r in res["breakdowns"]["position"]) == 5
    check("turn", 1, [2, 3, 8, 9])
    check("turn", 2, [5])
    check("version_lag", 0, [2, 3, 8, 9])
    check("version_lag", 1, [5])                      # step policy_version 3, token version 2
    assert set(rows(res, "version_lag")) == {0, 1}
    # rollout probability 0.8, 0.7 | 0.05 | 0.995 | 0.2
    assert [r["bucket"] for r in res["breakdowns"]["rollout_prob"]] == PROB_LABELS
    check("rollout_prob", "[0.5, 0.9)", [2, 3])
    check("rollout_prob", "[0.01, 0.1)", [5])
    check("rollout_prob", "[0.99, 1]", [8])
    check("rollout_prob", "[0.1, 0.5)", [9])
    assert rows(res, "rollout_prob")["[0, 0.01)"]["count"] == 0
    # entropy 0.05, 0.3, 1.5, 0.005, 3.0
    assert [r["bucket"] for r in res["breakdowns"]["entropy"]] == ENTROPY_LABELS
    check("entropy", "[0.01, 0.1)", [2])
    check("entropy", "[0.1, 0.5)", [3])
    check("entropy", "[1, 2)", [5])
    check("entropy", "[0, 0.01)", [8])
    check("entropy", "[2, 4)", [9])
    # signed mean of the turn-1 bucket: (0.1 − 0.2 + 0 − 0.25) / 4
    assert rows(res, "turn")[1]["mean"] == pytest.approx(-0.35 / 4, abs=1e-6)


def test_routing_agreement_and_delta_split(run):
    res = report(run, [0])
    r = res["routing"]
    # valid rows: t0 t1 t3 t4 t5 t7 t8 (t2 marked invalid, t6 and t9 end their samples) = 7.
    # layer 0: t8 differs ({0,1} vs {1,2}: one shared expert) → agreement 6/7, overlap (6·2+1)/14
    # layer 1: t4 differs ({0,1} vs {2,3}: nothing shared) → agreement 6/7, overlap 12/14
    # t1's train order is swapped ([1,0] vs [0,1]): the same set, so it agrees.
    assert r["rows"] == 7
    assert [x["agreement"] for x in r["layers"]] == pytest.approx([6 / 7, 6 / 7])
    assert [x["overlap"] for x in r["layers"]] == pytest.approx([13 / 14, 12 / 14])
    assert r["agreement"] == pytest.approx(12 / 14)
    assert r["overlap"] == pytest.approx(25 / 28)
    # Δ of token t by routing row t−1: t2←t1 agrees, t3←t2 invalid (unknown), t5←t4 differs,
    # t8←t7 agrees, t9←t8 differs
    toks = {x["t"]: abs(x["d"]) for x in stored(run, 0)}
    split = {x["bucket"]: x for x in r["delta"]}
    assert split["agrees"]["count"] == 2 and split["agrees"]["mean_abs"] == pytest.approx((toks[2] + toks[8]) / 2)
    assert split["differs"]["count"] == 2 and split["differs"]["mean_abs"] == pytest.approx((toks[5] + toks[9]) / 2)
    assert split["unknown"]["count"] == 1 and split["unknown"]["mean_abs"] == pytest.approx(toks[3])


def test_routing_agreement_function_order_insensitive():
    roll = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=np.uint8)       # [T=2, L=2, k=2]
    train = np.array([[[1, 0], [3, 2]], [[4, 6], [0, 1]]], dtype=np.uint8)
    agree, per_layer, hits = routing_agreement(roll, train)
    assert agree.tolist() == [[True, False], [True, False]]                      # [L, T]
    assert per_layer.tolist() == [1, 1] and hits.tolist() == [2 + 1, 2 + 0]
    k3 = np.array([[[0, 1, 2]], [[3, 4, 5]]], dtype=np.uint16)                   # k = 3, uint16 ids
    agree, per_layer, hits = routing_agreement(k3, k3[:, :, ::-1].copy())
    assert agree.all() and hits.tolist() == [6]


def test_top_tokens_with_context(run):
    res = report(run, [0], top_k=3)
    top = res["top"]
    assert [t["token"] for t in top] == [5, 9, 3]                                # |Δ| 0.3, 0.25, 0.2
    t5 = top[0]
    assert (t5["step"], t5["sample"], t5["sample_id"], t5["position"], t5["turn"], t5["policy_version"],
            t5["lag"], t5["routing"], t5["token_id"]) == (0, 0, 0, 0, 2, 2, 1, "differs", 16)
    assert t5["delta"] == pytest.approx(0.3, abs=1e-6)
    assert t5["rollout_prob"] == pytest.approx(0.05, rel=1e-6)
    assert top[1]["sample"] == 1 and top[1]["sample_id"] == 1 and top[1]["position"] == 1
    assert top[2]["routing"] == "unknown"
    # the context is decoded from the sample's own ids, with the token marked
    assert "⟦" in t5["context"] and "⟧" in t5["context"] and isinstance(t5["text"], str)


def test_all_steps_pool_tokens_and_per_step(run):
    res = report(run, None)
    toks = stored(run, 0) + stored(run, 1)
    ref = reference(toks)
    for key in ("mean_abs", "k3", "chi2", "ess", "pearson_prob", "p99_abs"):
        assert res["metrics"][key] == pytest.approx(ref[key], rel=1e-6), key
    assert res["steps"] == [0, 1] and res["tokens"]["analysed"] == 7
    per = {p["step"]: p for p in res["per_step"]}
    assert per[1]["mean_abs"] == pytest.approx(reference(stored(run, 1))["mean_abs"], rel=1e-9)
    assert per[1]["version_lag_mean"] == pytest.approx(0.5)                       # versions 4 and 3 at policy 4
    # step 1's routing is all default (0,1) → full agreement; pooled: 12 + 2·3 of 14 + 2·3 rows
    assert per[1]["routing_agreement"] == 1.0
    assert res["routing"]["agreement"] == pytest.approx((12 + 6) / (14 + 6))
    assert rows(res, "version_lag")[1]["count"] == 2                              # t5 of step 0, t33 of step 1


def test_parallel_workers_give_the_same_report(run):
    cfg = MismatchConfig.from_run_config(run.config, top_k=4)
    one, _ = mismatch_report(run, None, cfg, workers=1)
    two, _ = mismatch_report(run, None, cfg, workers=2)
    assert one["breakdowns"] == two["breakdowns"] and one["routing"] == two["routing"]
    assert one["top"] == two["top"] and one["per_step"] == two["per_step"]
    for k, v in one["metrics"].items():
        assert two["metrics"][k] == pytest.approx(v, rel=1e-12), k


def test_dense_trace_has_no_routing_and_empty_step(tmp_path):
    """No /routing group (dense model) → routing is None; a step without generated tokens → NaNs."""
    dense = tiny_record(0, 0, step1_samples(), routing=False)
    empty = tiny_record(1, 1, [TinySample([TinyToken(id=1), TinyToken(id=2)])], routing=False)
    write_run(tmp_path / "d", [dense, empty], config=CONFIG)
    reader = TraceReader(tmp_path / "d")
    res = report(reader, None)
    assert res["routing"] is None and res["tokens"]["analysed"] == 2
    per = {p["step"]: p for p in res["per_step"]}
    assert per[1]["analysed"] == 0 and math.isnan(per[1]["mean_abs"])
    res1 = report(reader, [1])
    assert math.isnan(res1["metrics"]["mean_abs"]) and res1["top"] == []


def test_compiled_routing_pass_matches_the_set_comparison():
    """The compiled whole-step pass (kernels.breakdown_block) counts what routing_agreement counts —
    per-layer agreeing rows and |A ∩ B| over valid rows — and splits |Δ| by row t − 1 exactly as the
    per-token path (step_tokens), for any layer count, k = 1..3, uint8/uint16 experts, valid masks
    dense or sparse, and samples that start anywhere."""
    from axrl_debug.analysis.mismatch import MismatchAccumulator, MismatchConfig, step_tokens

    rng = np.random.default_rng(1)
    cfg = MismatchConfig(breakdowns=False, top_k=3)
    for trial in range(40):
        t, layers, k = int(rng.integers(2, 600)), int(rng.integers(1, 7)), int(rng.integers(1, 4))
        experts = 8 if trial % 3 else 300
        roll = np.argsort(rng.random((t, layers, experts)), axis=2)[:, :, :k].astype(np.uint8 if experts <= 256 else np.uint16)
        train = roll.copy()
        moved = rng.random((t, layers)) < 0.3
        train[moved] = np.argsort(rng.random((int(moved.sum()), experts)), axis=1)[:, :k]
        swap = rng.random((t, layers)) < 0.5
        train[swap] = train[swap][:, ::-1]
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(t - 1, int(rng.integers(0, 6))), replace=False))
        cols = {"/samples/offsets": np.concatenate([[0], cuts, [t]]).astype(np.int64),
                "/tokens/loss_mask": (rng.random(t) < 0.8).astype(np.uint8),
                "/tokens/rollout_logprob": rng.normal(-1, 0.5, t).astype(np.float32),
                "/tokens/old_logprob": rng.normal(-1, 0.5, t).astype(np.float32),
                "/routing/rollout": roll, "/routing/train": train}
        valid = None if trial % 4 == 0 else rng.random(t) < (0.5 if trial % 2 else 0.97)
        if valid is not None:
            cols["/routing/rollout_valid"] = valid.astype(np.uint8)
        _, per_layer, hits = routing_agreement(roll, train, valid)
        whole, per_token = MismatchAccumulator(cfg), MismatchAccumulator(cfg)
        whole.add_columns(0, 0, cols)
        per_token.add(step_tokens(0, 0, cols, cfg))
        assert whole.layer_agree.tolist() == per_layer.tolist(), (t, layers, k)
        assert whole.layer_hits.tolist() == hits.tolist(), (t, layers, k)
        assert whole.result()["routing"] == per_token.result()["routing"]
        assert [(x.token, x.routing) for x in whole.top] == [(x.token, x.routing) for x in per_token.top]


def test_exact_percentiles_are_numpys():
    """p50/p99 come from a top-bits histogram and a selection inside the bins that hold the order
    statistics; the result is np.percentile's (linear) value bit for bit, ties and zeros included."""
    from axrl_debug.analysis.mismatch import _abs_hist, _exact_percentiles

    rng = np.random.default_rng(2)
    for trial in range(120):
        n = int(rng.choice([1, 3, 101, 70_000, 150_000]))     # > 65536: the histogram path
        values = [np.abs(rng.normal(0, 1e-3, n)), np.abs(rng.integers(0, 3, n) * 1e-7), np.zeros(n),
                  np.abs(rng.standard_cauchy(n))][trial % 4]
        a = values.astype(np.float32 if trial % 2 else np.float64)
        parts = [p for p in np.array_split(a, int(rng.integers(1, 5))) if p.size]
        hist = sum(_abs_hist(p) for p in parts) if trial % 3 else None
        qs = (50.0, 99.0) if trial % 5 else (0.0, 25.0, 50.0, 99.0, 100.0)
        assert _exact_percentiles(parts, hist, qs) == tuple(float(v) for v in np.percentile(a, list(qs)))


def test_whole_step_and_per_token_paths_agree(run):
    """add_columns (whole-step arrays) and add(step_tokens(...)) (per-token view) fold the same."""
    from axrl_debug.analysis.mismatch import MismatchAccumulator, step_tokens

    cfg = MismatchConfig.from_run_config(run.config, top_k=4)
    required, optional = cfg.columns()
    a, b = MismatchAccumulator(cfg), MismatchAccumulator(cfg)
    for sc in run.iter_columns(required, optional=optional, reuse_buffers=True):
        pv = int(sc.attrs["policy_version"])
        a.add_columns(sc.step, pv, sc.data)
        b.add(step_tokens(sc.step, pv, sc.data, cfg))
    ra, rb = a.result(), b.result()
    assert ra["breakdowns"] == rb["breakdowns"] and ra["routing"] == rb["routing"]
    assert ra["top"] == rb["top"] and ra["per_step"] == rb["per_step"]
    for key, value in ra["metrics"].items():
        assert rb["metrics"][key] == pytest.approx(value, rel=1e-12), key


def test_blocks_of_samples_give_the_step_report(run, tmp_path):
    """A step is processed in blocks of whole samples; any block size gives the same report."""
    from axrl_debug.analysis.mismatch import MismatchAccumulator

    cfg = MismatchConfig.from_run_config(run.config, top_k=4, per_step_percentiles=True)
    required, optional = cfg.columns()

    def fold(block: int) -> dict:
        acc = MismatchAccumulator(cfg)
        acc._block_tokens = block
        for sc in run.iter_columns(required, optional=optional):
            acc.add_columns(sc.step, int(sc.attrs["policy_version"]), sc.data)
        return acc.result()

    whole = fold(1 << 30)
    for block in (1, 2, 3, 5):
        part = fold(block)
        assert part["top"] == whole["top"] and part["routing"] == whole["routing"]
        assert part["tokens"] == whole["tokens"] and part["steps"] == whole["steps"]
        for key, value in whole["metrics"].items():
            assert part["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-15), (block, key)
        for name, rows in whole["breakdowns"].items():
            for a, b in zip(rows, part["breakdowns"][name]):
                assert a["bucket"] == b["bucket"] and a["count"] == b["count"], (block, name)
                assert b["mean_abs"] == pytest.approx(a["mean_abs"], rel=1e-12, nan_ok=True)
        for a, b in zip(whole["per_step"], part["per_step"]):
            assert a.keys() == b.keys()
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-15, nan_ok=True), (block, key)
