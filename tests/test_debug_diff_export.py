"""`diff` finds the first diverging step; `export` round-trips through pandas (Parquet and CSV);
the reader's column-selective / frame helpers."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from axrl.trace import TraceReader
from axrl_debug.analysis.diff import is_close, rel_diff
from axrl_debug.cli import app
from axrl_debug.synthetic import TinySample, TinyToken, gen
from trace_util import make_run


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def diff_run(path, *, change_from: int | None = None, steps: int = 5, fp: str = "fp"):
    """`make_run` whose values are a function of the step; from ``change_from`` on, loss is 1 %
    higher and the token sampled at the end differs (as after a code change)."""
    changed = lambda s: change_from is not None and s >= change_from  # noqa: E731
    loss = lambda s: (1.0 + 0.1 * s) * (1.01 if changed(s) else 1.0)  # noqa: E731

    def samples(s):
        return [TinySample([TinyToken(id=1), gen(0.5, 0.001, version=s, id=2),
                            gen(0.5, -0.001, version=s, id=9 if changed(s) else 3), TinyToken(id=4, route_valid=0)],
                           reward=0.5)]
    return make_run(path, range(steps), samples, lambda s: {"loss": [loss(s)], "grad_norm": [1.0], "lr": [1e-4]},
                    lambda s: {"loss": loss(s), "grad_norm": 1.0, "reward": 0.5},
                    fingerprint=lambda s: fp + ("x" if changed(s) else ""))


def test_diff_identical_runs(tmp_path):
    a, b = diff_run(tmp_path / "a"), diff_run(tmp_path / "b")
    r = invoke("diff", a, b)
    assert r.exit_code == 0 and "identical within tolerance" in r.stdout
    doc = json.loads(invoke("diff", a, b, "--json").stdout)
    assert doc["first_divergence"] is None and doc["first_token_divergence"] is None
    assert doc["common_steps"] == 5 and all(s["weights_equal"] for s in doc["steps"])


def test_diff_finds_first_diverging_step(tmp_path):
    a, b = diff_run(tmp_path / "a", change_from=3), diff_run(tmp_path / "b")
    r = invoke("diff", a, b)
    assert r.exit_code == 1 and "diverged at step 3" in r.stdout
    doc = json.loads(invoke("diff", a, b, "--json").stdout)
    assert doc["first_divergence"] == 3 and doc["first_weights_divergence"] == 3
    assert doc["first_token_divergence"] == 3 and doc["diverged_steps"] == 2
    moved = doc["steps"][3]["moved"]
    assert [m["metric"] for m in moved] == ["loss"]
    assert moved[0]["rel_diff"] == pytest.approx(0.01)
    # within a 2 % tolerance the metrics agree (tokens and weights still differ, reported apart)
    loose = json.loads(invoke("diff", a, b, "--json", "--rtol", "0.02").stdout)
    assert loose["first_divergence"] is None and loose["first_token_divergence"] == 3


def test_diff_steps_only_in_one_run(tmp_path):
    a, b = diff_run(tmp_path / "a", steps=5), diff_run(tmp_path / "b", steps=3)
    doc = json.loads(invoke("diff", a, b, "--json").stdout)
    assert doc["only_in_a"] == [3, 4] and doc["only_in_b"] == [] and doc["first_divergence"] is None


def test_tolerance_rule():
    assert is_close(1.0, 1.0 + 1e-6, 1e-5, 0) and not is_close(1.0, 1.0 + 1e-4, 1e-5, 0)
    assert is_close(float("nan"), float("nan"), 0, 0) and not is_close(float("nan"), 1.0, 1, 1)
    assert is_close(0.0, 1e-13, 0, 1e-12) and not is_close(float("inf"), 1e300, 1, 1)
    assert rel_diff(1.1, 1.0) == pytest.approx(0.1) and rel_diff(1.0, 0.0) == float("inf")


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_round_trip(tmp_path, fmt):
    run = diff_run(tmp_path / "run", steps=3)
    out = tmp_path / "export"
    r = invoke("export", run, "--format", fmt, "--out", out, "--routing", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["rows"] == {"tokens": 12, "samples": 3, "updates": 3, "steps": 3}
    read = pd.read_parquet if fmt == "parquet" else pd.read_csv
    tokens = read(out / f"tokens.{fmt}")
    samples = read(out / f"samples.{fmt}")
    steps = read(out / f"steps.{fmt}")
    updates = read(out / f"updates.{fmt}")
    reader = TraceReader(run)
    for s in range(3):
        with reader.open(s) as sf:
            t = tokens[tokens["step"] == s]
            assert t["ids"].tolist() == sf["/tokens/ids"].tolist()
            np.testing.assert_array_equal(t["rollout_logprob"].to_numpy(np.float32), sf["/tokens/rollout_logprob"])
            np.testing.assert_array_equal(t["old_logprob"].to_numpy(np.float32), sf["/tokens/old_logprob"])
            rr = sf["/routing/rollout"]
            assert t["routing_rollout_l1_k0"].tolist() == rr[:, 1, 0].tolist()
            assert t["routing_rollout_valid"].tolist() == sf["/routing/rollout_valid"].tolist()
    assert tokens["position"].tolist()[:4] == [0, 1, 2, 3]
    analysed = tokens["loss_mask"] == 1
    # CSV stores decimal text: go back through float32, the stored dtype, before differencing
    d = (tokens["old_logprob"].to_numpy(np.float32).astype(np.float64)
         - tokens["rollout_logprob"].to_numpy(np.float32).astype(np.float64))
    np.testing.assert_allclose(tokens.loc[analysed, "delta"], d[analysed], rtol=1e-6)
    assert tokens.loc[~analysed, "delta"].isna().all()
    assert samples["num_tokens"].tolist() == [4, 4, 4] and set(samples["status"]) == {"ok"}
    assert steps["loss"].tolist() == pytest.approx([1.0, 1.1, 1.2])
    assert steps["weights_fingerprint_after"].tolist() == ["fp-1", "fp-2", "fp-3"]
    assert updates["loss"].tolist() == pytest.approx([1.0, 1.1, 1.2])
    # joins on (step, sample)
    merged = tokens.merge(samples, on=["step", "sample"], suffixes=("", "_s"))
    assert len(merged) == 12 and (merged["reward"] == 0.5).all()


def test_export_refuses_a_file_as_out(tmp_path):
    run = diff_run(tmp_path / "run", steps=1)
    (tmp_path / "f").write_text("x")
    r = invoke("export", run, "--out", tmp_path / "f")
    assert r.exit_code == 2


def test_reader_column_helpers(tmp_path):
    run = diff_run(tmp_path / "run", steps=3)
    reader = TraceReader(run)
    cols = reader.columns(["/tokens/loss_mask", "/tokens/ids"], steps=[1, 2])
    assert cols["step"].tolist() == [1] * 4 + [2] * 4 and cols["/tokens/ids"].dtype == np.int32
    seen = [(sc.step, sorted(sc.data)) for sc in reader.iter_columns(["/tokens/ids"], optional=["/tokens/ref_logprob"])]
    assert seen == [(s, ["/tokens/ids"]) for s in range(3)]
    tf = reader.token_frame(columns=["ids", "entropy"])
    assert list(tf.columns) == ["step", "sample", "position", "entropy", "ids"] or \
        set(tf.columns) == {"step", "sample", "position", "entropy", "ids"}
    assert tf["entropy"].dtype == np.float32 and len(tf) == 12
    assert len(reader.sample_frame()) == 3 and len(reader.update_frame()) == 3
    with reader.open(0) as sf:
        assert sf.read_slice("/tokens/ids", 1, 3).tolist() == [2, 3]
        assert set(sf.read_columns(["/tokens/ids"], optional=["/nope"])) == {"/tokens/ids"}
        with pytest.raises(KeyError):
            sf.read_columns(["/nope"])
    # a damaged step is skipped and reported by the helpers too
    bad = run / "trace" / "step_000001.h5"
    bad.write_bytes(bad.read_bytes()[:100])
    reader = TraceReader(run)
    assert reader.token_frame()["step"].unique().tolist() == [0, 2]
    assert len(reader.problems) == 1
