"""Tests for axrl.trace: step file round trips, plain-h5py readability, crash safety (tmp files,
truncated/corrupt files, a SIGKILLed writer), validation errors, RunDir and resume truncation."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

import axrl
from axrl.trace import (
    SCHEMA_VERSION,
    CorruptStepError,
    NotARunDirError,
    RunDir,
    SchemaVersionError,
    StepFile,
    StepRecord,
    TraceReader,
    TraceValidationError,
    read_step,
    write_step,
)
from axrl.trace import schema as S

REPO = Path(__file__).resolve().parents[1]


def make_record(step: int = 0, *, seed: int = 0, n_groups: int = 4, group_size: int = 4,
                num_layers: int = 3, topk: int = 2, num_experts: int = 8, updates: int = 2,
                mean_len: int = 40) -> StepRecord:
    """A realistic random step: ragged multi-turn samples, env tokens, a failed empty sample,
    NaN logprobs where not generated, routing with invalid last rows, 2 updates x 2 micro-batches."""
    rng = np.random.default_rng(seed + 1000 * step)
    n = n_groups * group_size
    lengths = rng.integers(mean_len // 2, mean_len * 3 // 2, n)
    lengths[-1] = 0                                   # a failed sample that produced no tokens
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    t = int(off[-1])
    prompt_len = np.minimum(rng.integers(3, 10, n), lengths).astype(np.int32)
    loss_mask = np.zeros(t, np.uint8)
    turn = np.zeros(t, np.int16)
    pver = np.full(t, -1, np.int32)
    num_turns = np.zeros(n, np.int32)
    for i in range(n):
        a, b = int(off[i]), int(off[i + 1])
        if b == a:
            continue
        gen = np.arange(a + prompt_len[i], b)
        loss_mask[gen] = 1
        pver[gen] = step + int(rng.integers(0, 2))    # partial rollout: some tokens one version older
        if len(gen) > 6 and i % 2 == 0:               # a tool-result (env) segment mid-sample
            env = gen[len(gen) // 2: len(gen) // 2 + 3]
            loss_mask[env] = 0
            pver[env] = -1
            turn[env[0]:b] = 1
            num_turns[i] = 2
        else:
            num_turns[i] = 1
    rollout_lp = np.where(loss_mask == 1, -rng.exponential(1.0, t), np.nan).astype(np.float32)
    old_lp = (rollout_lp + rng.normal(0, 1e-4, t)).astype(np.float32)
    old_lp[loss_mask == 0] = rng.normal(-3, 1, int((loss_mask == 0).sum())).astype(np.float32)
    reward = rng.random(n)
    reward[3] = np.nan                                # could not be scored
    adv = np.repeat(reward - np.nanmean(reward), lengths).astype(np.float32)
    valid = np.ones(t, np.uint8)
    valid[off[1:][lengths > 0] - 1] = 0               # last token of each sample never fed as input
    routing_rollout = rng.integers(0, num_experts, (t, num_layers, topk)).astype(np.int64)
    routing_rollout[valid == 0] = 0
    routing_train = routing_rollout.copy()
    flip = rng.random(t) < 0.05
    routing_train[flip, 0, 0] = (routing_train[flip, 0, 0] + 1) % num_experts
    finish = ["stop"] * n
    finish[1] = "length"
    finish[2] = "abort"
    finish[-1] = "failed"
    status = ["ok"] * n
    status[-1] = "failed"
    error = [""] * n
    error[-1] = "EnvError: tool 'calculator' timed out after 30 s — «ünïcode»"
    trained = np.arange(n - 1)                        # the failed sample is not trained on
    perm = rng.permutation(trained)
    bounds = np.linspace(0, len(perm), updates + 1).astype(np.int64)
    mb_samples, mb_off, mb_update = [], [0], []
    for u in range(updates):
        chunk = perm[bounds[u]:bounds[u + 1]]
        for half in np.array_split(chunk, 2):
            mb_samples.extend(half.tolist())
            mb_off.append(len(mb_samples))
            mb_update.append(u)
    m = len(mb_update)
    return StepRecord(
        step=step, policy_version=step,
        sample_offsets=off, sample_id=np.arange(n, dtype=np.int64) + 100 * step,
        group_id=np.repeat(np.arange(n_groups), group_size).astype(np.int64) + 10 * step,
        prompt_id=[f"gsm8k/train/{g}" for g in np.repeat(np.arange(n_groups), group_size)],
        prompt_len=prompt_len, num_turns=num_turns, reward=reward,
        finish_reason=finish, status=status, error=error,
        token_ids=rng.integers(0, 151_000, t).astype(np.int32), loss_mask=loss_mask, turn=turn,
        token_policy_version=pver, rollout_logprob=rollout_lp, old_logprob=old_lp, advantage=adv,
        entropy=rng.random(t).astype(np.float16),
        ref_logprob=(old_lp - 0.01).astype(np.float32),
        is_weight=np.where(loss_mask > 0, rng.random(t), np.nan).astype(np.float32),
        loss_rule=np.where(loss_mask > 0, rng.integers(0, 1024, t), 0).astype(np.uint16),
        param_names=["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight"],
        param_grad_norm=rng.random((updates, 3)),
        behaviour_train_logprob=np.where(loss_mask == 1, old_lp - 0.001 * (pver != step), np.nan).astype(np.float32),
        num_experts=num_experts, routing_rollout=routing_rollout, routing_rollout_valid=valid,
        routing_train=routing_train,
        update_sample_offsets=bounds, update_samples=perm.astype(np.int64),
        update_metrics={"loss": rng.normal(size=updates), "grad_norm": rng.random(updates),
                        "lr": np.full(updates, 1e-6), "clipfrac": rng.random(updates),
                        "num_tokens": np.full(updates, 123, np.int64)},
        micro_batch_metrics={"update": np.array(mb_update, np.int32), "loss": rng.normal(size=m),
                             "num_tokens": rng.integers(10, 100, m).astype(np.int64)},
        micro_batch_sample_offsets=np.array(mb_off, np.int64), micro_batch_samples=np.array(mb_samples, np.int64),
        update_fingerprints=[f"{u:064x}" for u in range(updates)],
        weights_fingerprint_before="f" * 64, weights_fingerprint_after=f"{updates - 1:064x}",
        pool_dropped_group_id=np.array([7, 9, 8], np.int64) + 10 * step,
        pool_dropped_reason=["stale", "partial_drop", "dynamic_sampling"],
        pool_dropped_min_version=np.array([step - 3, -1, step], np.int32), pool_rerun_group_id=np.array([5], np.int64),
        # the dynamic-sampling group's two samples (3 + 2 tokens), never trained
        pool_sample_offsets=np.array([0, 3, 5], np.int64), pool_sample_id=np.array([80, 81], np.int64) + 100 * step,
        pool_group_id=np.array([8, 8], np.int64) + 10 * step, pool_prompt_id=["gsm8k/train/8"] * 2,
        pool_prompt_len=np.array([2, 1], np.int32), pool_num_turns=np.array([1, 1], np.int32),
        pool_reward=np.array([1.0, 1.0]), pool_finish_reason=["stop", "length"], pool_status=["ok", "ok"],
        pool_token_ids=np.array([5, 6, 7, 5, 9], np.int32), pool_turn=np.zeros(5, np.int16),
        pool_token_policy_version=np.array([-1, -1, step, -1, step], np.int32),
        pool_rollout_logprob=np.array([np.nan, np.nan, -0.5, np.nan, -1.5], np.float32),
        pool_routing_rollout=rng.integers(0, num_experts, (5, num_layers, topk)).astype(np.int64),
        session_id=[f"s{i // 2}" for i in range(n)], fork_of=np.where(np.arange(n) % 2, 100 * step, -1),
        fork_cause=["" if i % 2 == 0 else "history edited" for i in range(n)],
        drift_tokens=rng.integers(0, 3, n).astype(np.int32), drift=(rng.random(t) < 0.05).astype(np.uint8),
        turn_reward=rng.random(t).astype(np.float64),
        value=rng.standard_normal(t).astype(np.float32),
        returns=rng.standard_normal(t).astype(np.float32),
        wall_times={"rollout": 0.75, "advantages": 0.001, "train": 1.25, "sync": 0.01},
        rng_digest="0123456789abcdef",
        attrs={"temperature": 1.0, "engine": "embedded", "r3": True},
        extra_samples={"staleness": rng.integers(0, 2, n).astype(np.int32)},
        extra_tokens={"tool_call": (rng.random(t) < 0.1).astype(np.uint8)},
    )


def assert_records_equal(a: StepRecord, b: StepRecord) -> None:
    def eq(x, y, name):
        if isinstance(x, str) or isinstance(y, str):
            assert x == y, name
            return
        if isinstance(x, dict):
            assert set(x) == set(y), name
            for k in x:
                eq(x[k], y[k], f"{name}[{k!r}]")
            return
        if x is None or y is None:
            assert x is None and y is None, name
            return
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.dtype == object or ya.dtype == object or xa.dtype.kind == "U":
            assert [str(v) for v in xa.ravel()] == [str(v) for v in ya.ravel()], name
            return
        assert xa.shape == ya.shape, name
        assert np.array_equal(xa, ya, equal_nan=xa.dtype.kind == "f"), name

    for f in StepRecord.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if f == "routing_rollout" and x is not None:
            x = np.asarray(x)  # invalid rows are stored as zeros; make_record already zeroes them
        if isinstance(x, (int, float, bool)) and not isinstance(x, str):
            assert x == y, f
        else:
            eq(x, y, f)


# ============================================================================ round trip
def test_round_trip_exact(tmp_path):
    rec = make_record(step=7)
    path = write_step(tmp_path / "trace", rec)
    assert path.name == "step_000007.h5"
    with StepFile(path) as sf:
        back = sf.to_record()
        assert sf.step == 7 and sf.schema_version == SCHEMA_VERSION
        assert sf.num_tokens == rec.num_tokens and sf.num_samples == rec.num_samples
        # schema dtypes on disk
        for spec in S.DATASETS:
            assert spec.path in sf, spec.path
            if spec.np_dtype is not None:
                assert sf._f[spec.path].dtype == spec.np_dtype, spec.path
        assert sf._f["/routing/rollout"].dtype == np.uint8
        assert sf._f["/routing/rollout"].shape == (rec.num_tokens, 3, 2)
        assert np.isnan(sf["/tokens/rollout_logprob"][sf["/tokens/loss_mask"] == 0]).all()
        assert sf["/train/weights_fingerprint_before"] == "f" * 64
        assert sf["/samples/error"][-1].startswith("EnvError") and "ünïcode" in sf["/samples/error"][-1]
        assert sf.wall_times["train"] == 1.25
        assert sf.attrs["r3"] is True and sf.attrs["engine"] == "embedded"
        sl = sf.sample_slice(1)
        np.testing.assert_array_equal(sf["/tokens/ids"][sl], rec.token_ids[rec.sample_offsets[1]:rec.sample_offsets[2]])
    assert_records_equal(rec, back)

    d = read_step(path)
    assert d["attrs"]["step"] == 7 and d["attrs"]["schema_version"] == SCHEMA_VERSION
    assert d["group_attrs"]["/routing"]["num_experts"] == 8
    assert set(S.DATASETS_BY_PATH) <= set(d)
    np.testing.assert_array_equal(d["/tokens/ids"], rec.token_ids)

    # the rebuilt record writes an identical file content
    back.step = 8
    with StepFile(write_step(tmp_path / "trace", back)) as sf2, StepFile(path) as sf1:
        assert sf1.keys() == sf2.keys()
        for k in sf1.keys():
            a, b = sf1[k], sf2[k]
            if isinstance(a, np.ndarray) and a.dtype.kind == "f":
                assert np.array_equal(a, b, equal_nan=True), k
            elif isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), k
            elif k != "/samples/sample_id":
                assert a == b, k


def test_uint16_routing_and_minimal_record(tmp_path):
    rec = make_record(num_experts=300)
    rec.routing_train = None
    with StepFile(write_step(tmp_path, rec)) as sf:
        assert sf._f["/routing/rollout"].dtype == np.uint16
        assert int(sf["/routing/rollout"].max()) >= 256
        assert "/routing/train" not in sf
    # no routing, no optional fields, no updates (e.g. every sample failed)
    n = 2
    bare = StepRecord(
        step=1, policy_version=0, sample_offsets=[0, 3, 5], sample_id=[0, 1], group_id=[0, 0],
        prompt_id=["a", "a"], prompt_len=[3, 2], num_turns=[0, 0], reward=[0.0, 0.0],
        finish_reason=["failed"] * n, status=["failed"] * n,
        token_ids=[1, 2, 3, 4, 5], loss_mask=[0] * 5, turn=[0] * 5, token_policy_version=[-1] * 5,
        rollout_logprob=[math.nan] * 5, old_logprob=[0.0] * 5, advantage=[0.0] * 5, entropy=[0.0] * 5,
        update_sample_offsets=[0], update_samples=[], update_metrics={},
        weights_fingerprint_before="x", weights_fingerprint_after="x")
    with StepFile(write_step(tmp_path, bare)) as sf:
        back = sf.to_record()
        assert sf.attrs["num_updates"] == 0 and sf.attrs["num_micro_batches"] == 0
        assert "/routing/rollout" not in sf and "/tokens/ref_logprob" not in sf
        assert list(sf["/samples/error"]) == ["", ""]
        assert sf["/train/updates/loss"].shape == (0,)
    assert back.routing_rollout is None and back.num_experts is None and back.ref_logprob is None


def test_plain_h5py_without_axrl(tmp_path):
    rec = make_record(step=3)
    path = write_step(tmp_path / "trace", rec)
    script = textwrap.dedent(f"""
        import sys, json
        sys.modules["axrl"] = None          # any attempt to import axrl now raises ImportError
        import h5py, numpy as np
        with h5py.File({str(path)!r}, "r") as f:
            off = f["/samples/offsets"][:]
            ids = f["/tokens/ids"][:]
            lp = f["/tokens/rollout_logprob"][:]
            i = 1
            out = {{
                "step": int(f.attrs["step"]), "schema_version": int(f.attrs["schema_version"]),
                "sample1_ids": ids[off[i]:off[i + 1]].tolist(),
                "nan": int(np.isnan(lp).sum()),
                "finish": f["/samples/finish_reason"].asstr()[:].tolist(),
                "fp": f["/train/weights_fingerprint_after"].asstr()[()],
                "routing": list(f["/routing/train"].shape),
                "upd": f["/train/update_samples"][f["/train/updates/sample_offsets"][0]:f["/train/updates/sample_offsets"][1]].tolist(),
            }}
        assert not any(m == "axrl" or m.startswith("axrl.") for m in sys.modules if sys.modules[m] is not None)
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    off = rec.sample_offsets
    assert out["step"] == 3 and out["schema_version"] == SCHEMA_VERSION
    assert out["sample1_ids"] == rec.token_ids[off[1]:off[2]].tolist()
    assert out["nan"] == int(np.isnan(rec.rollout_logprob).sum())
    assert out["finish"] == rec.finish_reason
    assert out["fp"] == rec.weights_fingerprint_after
    assert out["routing"] == [rec.num_tokens, 3, 2]
    uo = rec.update_sample_offsets
    assert out["upd"] == rec.update_samples[uo[0]:uo[1]].tolist()


# ============================================================================ validation
def _bad(rec: StepRecord, **changes) -> StepRecord:
    for k, v in changes.items():
        setattr(rec, k, v)
    return rec


@pytest.mark.parametrize("changes, field", [
    (lambda r: dict(token_ids=r.token_ids[:-1]), "token_ids"),
    (lambda r: dict(entropy=np.zeros((r.num_tokens, 2), np.float16)), "entropy"),
    (lambda r: dict(loss_mask=np.full(r.num_tokens, 2, np.uint8)), "loss_mask"),
    (lambda r: dict(token_ids=r.token_ids.astype(np.float32)), "token_ids"),
    (lambda r: dict(turn=np.full(r.num_tokens, 40_000)), "turn"),
    (lambda r: dict(reward=r.reward[:-1]), "reward"),
    (lambda r: dict(prompt_id=r.prompt_id[:-1]), "prompt_id"),
    (lambda r: dict(status=[1] * r.num_samples), "status"),
    (lambda r: dict(sample_offsets=np.asarray(r.sample_offsets)[::-1].copy()), "sample_offsets"),
    (lambda r: dict(prompt_len=np.asarray(r.prompt_len) + 1000), "prompt_len"),
    (lambda r: dict(routing_train=np.asarray(r.routing_train)[:, :2]), "routing_train"),
    (lambda r: dict(routing_rollout=np.asarray(r.routing_rollout)[:-1]), "routing_rollout"),
    (lambda r: dict(routing_train=np.asarray(r.routing_train) + 8), "routing_train"),
    (lambda r: dict(num_experts=None), "num_experts"),
    (lambda r: dict(update_samples=np.asarray(r.update_samples) + 100), "update_samples"),
    (lambda r: dict(update_sample_offsets=[0, 1]), "update_sample_offsets"),
    (lambda r: dict(update_metrics={"loss": [1.0, 2.0]}), "update_metrics"),
    (lambda r: dict(update_metrics={**r.update_metrics, "lr": [1.0]}), "update_metrics['lr']"),
    (lambda r: dict(micro_batch_metrics={**r.micro_batch_metrics, "update": [0, 0, 1, 5]}),
     "micro_batch_metrics['update']"),
    (lambda r: dict(micro_batch_sample_offsets=[0, 1]), "micro_batch_sample_offsets"),
    (lambda r: dict(weights_fingerprint_after=None), "weights_fingerprint_after"),
    (lambda r: dict(update_fingerprints=["a"]), "update_fingerprints"),
    (lambda r: dict(extra_tokens={"x": np.zeros(3)}), "extra_tokens['x']"),
    (lambda r: dict(extra_samples={"reward": np.zeros(r.num_samples)}), "extra_samples"),
    (lambda r: dict(attrs={"step": 3}), "attrs"),
    (lambda r: dict(step=-1), "step"),
    (lambda r: dict(pool_group_id=np.asarray(r.pool_group_id) + 100), "pool_group_id"),
    (lambda r: dict(pool_token_ids=np.asarray(r.pool_token_ids)[:-1]), "pool_token_ids"),
    (lambda r: dict(pool_reward=None), "pool_reward"),
    (lambda r: dict(pool_routing_rollout=np.asarray(r.pool_routing_rollout) + 8), "pool_routing_rollout"),
])
def test_validation_names_field(tmp_path, changes, field):
    rec = make_record()
    rec = _bad(rec, **changes(rec))
    with pytest.raises(TraceValidationError) as ei:
        write_step(tmp_path, rec)
    assert f"StepRecord.{field}" in str(ei.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a tmp file


def test_write_refuses_overwrite_and_run_dir(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_manifest(seed=0)
    rec = make_record()
    run.write_step(rec)
    with pytest.raises(FileExistsError):
        run.write_step(rec)
    run.write_step(rec, overwrite=True)
    with pytest.raises(ValueError, match="trace"):
        write_step(run.path, rec)


# ============================================================================ crash safety
def _write_steps(run: RunDir, steps) -> None:
    for s in steps:
        run.write_step(make_record(step=s, n_groups=2, group_size=2))


def test_tmp_files_never_listed(tmp_path):
    run = RunDir(tmp_path / "run")
    _write_steps(run, [0, 1])
    (run.trace_dir / "step_000002.h5.tmp").write_bytes(b"\x89HDF half written")
    (run.trace_dir / "step_000003.h5.tmp").write_bytes(b"")
    (run.trace_dir / "notes.txt").write_text("not a step")
    assert run.completed_steps() == [0, 1]
    reader = TraceReader(run.path)
    assert reader.steps == [0, 1] and reader.problems == []
    assert [p.name for p in reader.tmp_files()] == ["step_000002.h5.tmp", "step_000003.h5.tmp"]
    removed = run.clean_tmp()
    assert sorted(p.name for p in removed) == ["step_000002.h5.tmp", "step_000003.h5.tmp"]
    assert reader.tmp_files() == [] and run.completed_steps() == [0, 1]


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.97])
def test_truncated_file_reported_and_skipped(tmp_path, keep):
    run = RunDir(tmp_path / "run")
    run.write_manifest(seed=1)
    _write_steps(run, [0, 1, 2])
    bad = run.step_path(1)
    data = bad.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)])
    reader = TraceReader(run.path)
    assert reader.steps == [0, 2]
    assert len(reader.problems) == 1 and reader.problems[0].path == bad
    assert str(bad) in str(reader.problems[0])
    with pytest.raises(CorruptStepError, match="step_000001"):
        reader.open(1)
    opened = [sf.step for sf in reader]
    assert opened == [0, 2]
    with pytest.raises(CorruptStepError, match=str(bad)):
        StepFile(bad)


def test_storage_layout_of_token_datasets(tmp_path):
    """Every token dataset is chunked and checksummed; the columns the analyses read per token are
    stored raw, the others gzip-1 + shuffle; chunks are even (no mostly-padding last chunk)."""
    from axrl.trace.writer import RAW_DATASETS

    path = write_step(tmp_path, make_record(n_groups=8, group_size=8, mean_len=400))
    with h5py.File(path, "r") as f:
        seen = []
        for group in ("tokens", "routing"):
            for name, ds in f[group].items():
                full = f"/{group}/{name}"
                seen.append(full)
                assert ds.fletcher32 and ds.chunks is not None, full
                if full in RAW_DATASETS:
                    assert ds.compression is None and not ds.shuffle, full
                else:
                    assert ds.compression == "gzip" and ds.compression_opts == 1 and ds.shuffle, full
                rows, n = ds.chunks[0], ds.shape[0]
                assert n - (-(-n // rows) - 1) * rows > rows // 2 or n == rows, (full, rows, n)
        assert {"/tokens/ids", "/tokens/advantage", "/tokens/old_logprob", "/routing/train"} <= set(seen)
        assert f["/samples/offsets"].chunks is None                  # small datasets stay contiguous
    # the old all-gzip layout and plain contiguous storage stay available
    all_gz = write_step(tmp_path / "gz", make_record(), raw=frozenset())
    plain = write_step(tmp_path / "plain", make_record(), compression=None, checksum=False)
    with h5py.File(all_gz, "r") as f, h5py.File(plain, "r") as g:
        assert f["/tokens/old_logprob"].compression == "gzip"
        assert g["/tokens/ids"].chunks is None and not g["/tokens/ids"].fletcher32
        np.testing.assert_array_equal(f["/tokens/old_logprob"][()], g["/tokens/old_logprob"][()])


def test_behaviour_train_logprob_round_trip(tmp_path):
    """The optional /tokens/behaviour_train_logprob: stored raw and checksummed like old_logprob
    (the analysis reads it per token), read back by HDF5's and the compiled reader's paths; absent
    when not given; a wrong length is rejected naming the field."""
    rec = make_record(n_groups=8, group_size=8, mean_len=400)
    b = np.asarray(rec.behaviour_train_logprob)
    run = RunDir(tmp_path / "run")
    with h5py.File(run.write_step(rec), "r") as f:
        ds = f["/tokens/behaviour_train_logprob"]
        assert ds.dtype == np.float32 and ds.compression is None and ds.fletcher32
    name = "/tokens/behaviour_train_logprob"
    for fast in (False, True):
        (sc,) = TraceReader(run.path).iter_columns([name], fast_checksums=fast)
        np.testing.assert_array_equal(sc[name], b)
    rec.behaviour_train_logprob = None
    with StepFile(write_step(tmp_path / "bare", rec)) as sf:
        assert name not in sf and sf.to_record().behaviour_train_logprob is None
    rec.behaviour_train_logprob = b[:-1]
    with pytest.raises(TraceValidationError, match="behaviour_train_logprob"):
        write_step(tmp_path / "bad", rec)


def test_iter_columns_reuses_buffers(tmp_path):
    run = RunDir(tmp_path / "run")
    _write_steps(run, [0, 1, 2])
    reader = TraceReader(run.path)
    names = ["/samples/offsets", "/tokens/old_logprob", "/routing/train"]
    # largest step first: its buffers are big enough for the others
    sizes = {}
    for step in reader.steps:
        with reader.open(step) as sf:
            sizes[step] = sf.num_tokens
    steps = sorted(sizes, key=lambda s: -sizes[s])
    fresh = [dict(sc.data) for sc in reader.iter_columns(names, steps)]
    seen = []
    for sc, ref in zip(reader.iter_columns(names, steps, reuse_buffers=True), fresh):
        for name in names:
            np.testing.assert_array_equal(sc[name], ref[name])
        seen.append(sc["/tokens/old_logprob"])
    assert all(a.base is not None and a.base is seen[0].base for a in seen)   # one growing buffer


def test_corrupt_chunk_detected_by_checksum(tmp_path):
    path = write_step(tmp_path, make_record())
    with h5py.File(path, "r") as f:
        info = f["/tokens/ids"].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xde\xad\xbe\xef" * 4)
    with StepFile(path) as sf:
        with pytest.raises(CorruptStepError, match="/tokens/ids"):
            sf["/tokens/ids"]
        assert sf["/samples/offsets"][0] == 0  # the rest of the file still reads


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        TraceReader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunDirError, match="not an AxRL run directory"):
        TraceReader(tmp_path / "empty")
    run = RunDir(tmp_path / "future")
    run.write_manifest()
    m = run.read_manifest()
    m["schema_version"] = SCHEMA_VERSION + 1
    run.manifest_path.write_text(json.dumps(m))
    with pytest.raises(SchemaVersionError, match="unknown schema_version"):
        TraceReader(run.path)
    # a step file from the future is reported, not crashed on
    run2 = RunDir(tmp_path / "run2")
    _write_steps(run2, [0, 1])
    with h5py.File(run2.step_path(1), "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    reader = TraceReader(run2.path)
    assert reader.steps == [0]
    assert "unknown schema_version" in reader.problems[0].message
    with pytest.raises(SchemaVersionError):
        StepFile(run2.step_path(1))
    # a step file whose attr disagrees with its name
    os.replace(run2.step_path(0), run2.step_path(5))
    reader.refresh()
    assert reader.steps == [] and any("does not match" in p.message for p in reader.problems)
    with pytest.raises(KeyError):
        TraceReader(run2.path).open(42)


KILL_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_trace import make_record
from axrl.trace import RunDir
run = RunDir({run!r})
rec = make_record(step=0, n_groups=8, group_size=8, num_layers=8, topk=4, mean_len=400)
for step in range(100000):
    rec.step = step
    rec.token_ids = (np.asarray(rec.token_ids) + 1) % 151000
    run.write_step(rec)
    run.append_metrics({{"step": step, "loss": float(step)}})
    print(step, flush=True)
"""


def test_killed_writer_leaves_only_complete_files(tmp_path):
    for attempt, delay in enumerate((0.0, 0.013, 0.031)):
        run_path = tmp_path / f"run{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-c", KILL_SCRIPT.format(tests=str(Path(__file__).parent), run=str(run_path))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            for _ in range(3 + attempt):  # wait until a few steps are complete
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
            time.sleep(delay)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL
        run = RunDir(run_path, create=False)
        reader = TraceReader(run_path)
        steps = reader.steps
        assert reader.problems == []
        assert len(steps) >= 3 + attempt and steps == list(range(len(steps)))
        for sf in reader:
            with sf:
                assert sf["/tokens/ids"].shape[0] == sf["/samples/offsets"][-1]
                assert sf["/routing/rollout"].shape[1:] == (8, 4)
        tmps = reader.tmp_files()
        assert len(tmps) <= 1 and all(p.name.endswith(".h5.tmp") for p in tmps)
        # metrics lags the step file by at most one line
        assert [r["step"] for r in run.read_metrics()] in (steps, steps[:-1])
        # resume: drop the stray tmp and anything after the last complete step
        run.truncate_after(steps[-1])
        assert reader.tmp_files() == [] and run.completed_steps() == steps


# ============================================================================ RunDir
def test_run_dir_manifest_config_metrics(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.trace_dir.is_dir() and run.checkpoints_dir.is_dir()
    manifest = run.write_manifest(seed=1234, backend="torch", engine="embedded", threads=1,
                                  command=["axrl", "train", "x.yaml"], extra={"note": "t"})
    on_disk = run.read_manifest()
    assert on_disk == json.loads(json.dumps(manifest))
    assert on_disk["schema_version"] == SCHEMA_VERSION
    assert on_disk["axrl_version"] == axrl.__version__
    assert on_disk["seed"] == 1234 and on_disk["backend"] == "torch" and on_disk["engine"] == "embedded"
    assert on_disk["threads"] == 1 and on_disk["command"] == ["axrl", "train", "x.yaml"]
    assert set(on_disk["versions"]) >= {"python", "torch", "numpy", "h5py"}
    assert on_disk["versions"]["h5py"] == h5py.__version__ and on_disk["versions"]["numpy"] == np.__version__
    assert on_disk["host"] and on_disk["start_time"] and "git_sha" in on_disk
    assert on_disk["extra"] == {"note": "t"}
    run.record_resume(4, command=["axrl", "train", "--resume"])
    assert run.read_manifest()["resumes"][0]["from_step"] == 4
    assert run.read_manifest()["start_time"] == on_disk["start_time"]

    config = {"steps": 3, "seed": 1234, "rollout": {"engine": "embedded", "temperature": 1.0},
              "train": {"backend": "torch", "lr": 1e-6}, "r3": False, "tags": ["a", "b"]}
    run.write_config(config)
    assert yaml.safe_load(run.config_path.read_text()) == config
    assert run.read_config() == config
    assert TraceReader(run.path).config == config

    run.append_metrics({"step": 0, "loss": 0.5, "grad_norm": np.float32(1.5), "n": np.int64(3)})
    run.append_metrics({"step": np.int64(1), "loss": float("nan"), "reward": 0.25,
                        "nested": {"x": float("inf"), "ok": [1.0, float("-inf")]}})
    lines = run.metrics_path.read_text().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in lines]
    assert rows == run.read_metrics()
    assert rows[0] == {"step": 0, "loss": 0.5, "grad_norm": 1.5, "n": 3}
    # strict JSON: what could not be measured is null, never NaN / Infinity
    assert rows[1] == {"step": 1, "loss": None, "reward": 0.25, "nested": {"x": None, "ok": [1.0, None]}}
    with pytest.raises(ValueError, match="step"):
        run.append_metrics({"loss": 1.0})
    # a line cut by a crash is skipped and reported
    with open(run.metrics_path, "a") as fh:
        fh.write('{"step": 2, "lo')
    reader = TraceReader(run.path)
    assert [r["step"] for r in reader.metrics()] == [0, 1]
    assert any("metrics.jsonl:3" in str(p) for p in reader.problems)
    assert RunDir(run.path, create=False).path == run.path
    with pytest.raises(FileNotFoundError):
        RunDir(tmp_path / "missing", create=False)


def test_truncate_after(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_manifest(seed=0)
    _write_steps(run, range(5))
    for s in range(5):
        run.append_metrics({"step": s, "loss": s / 10})
    with open(run.metrics_path, "a") as fh:
        fh.write('{"step": 5, "lo')            # partial line of a crashed step
    (run.trace_dir / "step_000005.h5.tmp").write_bytes(b"partial")
    removed = run.truncate_after(2)
    assert sorted(p.name for p in removed) == ["step_000003.h5", "step_000004.h5"]
    assert run.completed_steps() == [0, 1, 2]
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2]
    assert run.metrics_path.read_text().count("\n") == 3
    assert run.tmp_files() == []
    assert TraceReader(run.path).steps == [0, 1, 2]
    # resume continues appending after the truncation point
    run.write_step(make_record(step=3, n_groups=2, group_size=2))
    run.append_metrics({"step": 3, "loss": 0.0})
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2, 3]
    run.truncate_after(-1)
    assert run.completed_steps() == [] and run.read_metrics() == []


def test_compiled_fletcher32_reads_what_hdf5_reads(tmp_path):
    """The analysis path verifies raw chunks itself (axrl/trace/checksum.py): same data as HDF5's
    read for row-chunked datasets of every shape the trace uses (edge chunks, odd byte counts,
    [T, L, k] rows), and a flipped byte in any chunk is a ChecksumError naming that chunk."""
    from axrl.trace.checksum import ChecksumError, checksummed_raw, padded_bytes, read_checksummed

    rng = np.random.default_rng(3)
    path = tmp_path / "c.h5"
    specs = [((1000, ), np.float32, 96), ((333, 4, 2), np.uint8, 50), ((7,), np.int16, 3),
             ((1001,), np.uint8, 333), ((5,), np.float64, 2), ((64, 3, 3), np.uint16, 64)]
    with h5py.File(path, "w") as f:
        for i, (shape, dt, rows) in enumerate(specs):
            f.create_dataset(f"d{i}", data=(rng.random(shape) * 200).astype(dt), chunks=(rows, *shape[1:]),
                             fletcher32=True)
        f.create_dataset("gz", data=np.arange(10), chunks=(5,), fletcher32=True, compression="gzip")
    with h5py.File(path, "r") as f:
        assert not checksummed_raw(f["gz"])
        for i in range(len(specs)):
            ds = f[f"d{i}"]
            assert checksummed_raw(ds)
            got = read_checksummed(ds, np.empty(padded_bytes(ds), np.uint8))
            np.testing.assert_array_equal(got, ds[()])
            assert got.dtype == ds.dtype and got.shape == ds.shape
        info = f["d3"].id.get_chunk_info(2)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 7)
        fh.write(bytes([fh.read(1)[0] ^ 0x10]))
    with h5py.File(path, "r") as f:
        with pytest.raises(ChecksumError, match="chunk 2"):
            read_checksummed(f["d3"], np.empty(padded_bytes(f["d3"]), np.uint8))


# ---------------------------------------------------------------------------- the background writer
def test_background_writer_keeps_order_bounds_the_queue_and_reports_failures(tmp_path):
    """`StepWriter` (trace.write_queue): records are written in order by its thread, the same
    files a direct write gives; with a slow disk the caller waits once the queue is full (and is
    told how long); `flush` returns only when all are on disk; a failed write is raised on the
    next call, naming the step, and later steps are not written past it."""
    import threading

    from axrl.runtime.recording.step_writer import StepWriter

    run = RunDir(tmp_path / "run")
    gate, written = threading.Event(), []

    def slow_write(record):
        gate.wait(10)
        written.append(record.step)
        return run.write_step(record)

    writer = StepWriter(slow_write, max_pending=2)
    assert writer.submit(make_record(0)) < 0.5 and writer.submit(make_record(1)) < 0.5
    waits = []
    t = threading.Thread(target=lambda: waits.append(writer.submit(make_record(2))))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "a third record went into a queue of two while the first was still being written"
    gate.set()
    t.join(10)
    assert waits and waits[0] >= 0.25
    writer.flush()
    assert written == [0, 1, 2] and run.completed_steps() == [0, 1, 2]
    direct = write_step(tmp_path / "direct", make_record(1))
    with StepFile(run.trace_dir / "step_000001.h5") as a, StepFile(direct) as b:
        assert_records_equal(a.to_record(), b.to_record())

    def failing(record):
        if record.step == 4:
            raise OSError("disk full")
        return run.write_step(record)

    bad = StepWriter(failing, max_pending=2)
    bad.submit(make_record(3))
    bad.submit(make_record(4))
    bad.submit(make_record(5))
    with pytest.raises(RuntimeError, match="step 4 failed: OSError: disk full"):
        bad.flush()
    with pytest.raises(RuntimeError, match="step 4"):
        bad.close()
    assert run.completed_steps() == [0, 1, 2, 3]
