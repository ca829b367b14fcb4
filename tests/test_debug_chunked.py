"""Bounded-memory reading: a step read in chunks of whole samples (`axrl/trace/chunks.py`) gives the
analyses (`mismatch`, the step table of `summary` / `spikes` / `check`, the TUI's samples table)
the answers they give from whole columns — exactly at the default chunk size on normal steps, and
up to float summation order when a tiny chunk size forces many chunks — on a real recorded MoE run,
its routing stored raw and packed. Peak memory does not grow with the step."""

from __future__ import annotations

import json
import math
import shutil
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from axrl.trace import RunDir, StepFile, TraceReader
from axrl.trace.chunks import iter_chunks
from axrl_debug.analysis import frames
from axrl_debug.analysis.mismatch import MismatchConfig, analyse
from axrl_debug.analysis.mismatch.accumulator import _read_steps
from axrl_debug.synthetic import write_run
from train_util import ROOT, train

RUN_SETTINGS = ["steps=2", "model.preset=micro-moe", "warmup.steps=100", "data.task=echo", "data.task_args={}",
                "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0",
                "runtime.threads=1", "algo.loss_agg=token-mean"]


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory) -> Path:
    """A real run: two steps of the echo task on the micro MoE (routing recorded)."""
    path = tmp_path_factory.mktemp("chunked") / "raw"
    train(path, RUN_SETTINGS)
    return path


@pytest.fixture(scope="module")
def packed_run(raw_run, tmp_path_factory) -> Path:
    """The same steps with their routing stored packed (rewritten through the trace writer)."""
    path = tmp_path_factory.mktemp("chunked") / "packed"
    shutil.copytree(raw_run, path)
    rd = RunDir(path)
    for step_path in sorted((path / "trace").glob("step_*.h5")):
        with StepFile(step_path) as sf:
            rec = sf.to_record()
        step_path.unlink()
        rd.write_step(rec, routing_encoding="packed")
    return path


@pytest.fixture(params=["raw", "packed"])
def run(request, raw_run, packed_run) -> TraceReader:
    return TraceReader(raw_run if request.param == "raw" else packed_run)


@pytest.fixture(params=[False, True], ids=["numpy", "compiled"])
def cfg(request, run) -> MismatchConfig:
    return MismatchConfig.from_run_config(run.config, top_k=8, compiled=request.param)


def whole_columns(reader: TraceReader, cfg: MismatchConfig) -> dict:
    """The report from whole columns (every dataset of a step read at once)."""
    required, optional = cfg.columns()
    return analyse(reader.iter_columns(required, optional=optional), cfg).result()


def chunk_counts(reader: TraceReader, chunk_tokens: int) -> list[int]:
    out = []
    for step in reader.steps:
        with reader.open(step) as sf:
            out.append(sum(1 for _ in iter_chunks(sf, ["/samples/offsets"], chunk_tokens=chunk_tokens)))
    return out


def test_the_run_is_moe(run):
    with run.open(run.steps[0]) as sf:
        assert sf["/routing/rollout"].shape[1:] == sf["/routing/train"].shape[1:] and sf.num_samples == 8
        assert (sf.group_attrs("/routing").get("encoding") == "packed-v1") == (run.path.name == "packed")


def test_chunked_mismatch_is_the_whole_column_report(run, cfg):
    """At the default chunk size a normal step is one chunk: the same JSON, bit for bit."""
    assert json.dumps(_read_steps(run, run.steps, cfg).result()) == json.dumps(whole_columns(run, cfg))


def assert_close(part: dict, whole: dict) -> None:
    """Counts, routing, worst tokens and percentiles exact; float sums up to summation order."""
    assert part["tokens"] == whole["tokens"] and part["steps"] == whole["steps"]
    assert part["routing"] == whole["routing"] and part["top"] == whole["top"]
    for key, value in whole["metrics"].items():
        exact = key in ("p50_abs", "p99_abs", "max_abs", "ratio_min", "ratio_max") or key.startswith("frac")
        assert part["metrics"][key] == (value if exact else pytest.approx(value, rel=1e-12, abs=1e-15)), key
    for name, rows in whole["breakdowns"].items():
        for a, b in zip(rows, part["breakdowns"][name], strict=True):
            assert a["bucket"] == b["bucket"] and a["count"] == b["count"], name
            assert b["mean_abs"] == pytest.approx(a["mean_abs"], rel=1e-12, nan_ok=True), name
    for a, b in zip(whole["per_step"], part["per_step"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-15, nan_ok=True), key


@pytest.mark.parametrize("chunk_tokens", [1, 40, 100])
def test_tiny_chunks_give_the_same_report(run, cfg, chunk_tokens):
    """A chunk size forcing several chunks per step: float sums are added chunk by chunk, so
    they may differ from one pass in the last bits (rel 1e-12); nothing else may move."""
    assert min(chunk_counts(run, chunk_tokens)) > 1
    small = replace(cfg, chunk_tokens=chunk_tokens)
    assert_close(_read_steps(run, run.steps, small).result(), whole_columns(run, cfg))


def test_step_table_chunked(run):
    """summary / spikes / check: the step table from chunks is the whole-column figures."""
    cfg = MismatchConfig.from_run_config(run.config)
    df = frames.step_table(run, cfg=cfg)
    whole = whole_columns(run, replace(cfg, per_step_percentiles=True))
    for rec, head in zip(df.to_dict(orient="records"), whole["per_step"], strict=True):
        assert rec["mismatch"] == head["mean_abs"] and rec["mismatch_p99"] == head["p99_abs"]
        assert rec["routing_agreement"] == head["routing_agreement"] and rec["tokens"] == head["tokens"]
        with run.open(rec["step"]) as sf:
            adv = np.asarray(sf["/tokens/advantage"], np.float64)[np.asarray(sf["/tokens/loss_mask"]) != 0]
        assert rec["advantage_abs_mean"] == frames._nanmean(np.abs(adv))
    tiny = frames.step_table(run, cfg=replace(cfg, chunk_tokens=16))
    for a, b in zip(df.to_dict(orient="records"), tiny.to_dict(orient="records"), strict=True):
        for key, value in a.items():
            if isinstance(value, float):
                assert b[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
            else:
                assert b[key] == value, key


def test_chunks_are_whole_samples_and_the_stored_rows(run):
    names = ["/samples/offsets", "/samples/reward", "/tokens/ids", "/tokens/old_logprob", "/routing/rollout",
             "/routing/train", "/routing/rollout_valid", "/train/updates/loss"]
    for chunk_tokens in (1, 37, 1 << 20):
        with run.open(run.steps[-1]) as sf:
            names = [n for n in names if n in sf]
            assert "/routing/train" in names
            off = np.asarray(sf["/samples/offsets"])
            longest = int(np.diff(off).max())
            seen = 0
            for ch in iter_chunks(sf, names, chunk_tokens=chunk_tokens, fast_checksums=chunk_tokens == 37):
                assert ch.sample0 == seen and ch.token0 == off[ch.sample0] and ch.token1 == off[ch.sample1]
                assert ch.num_tokens <= chunk_tokens + longest
                assert np.array_equal(ch["/samples/offsets"], off[ch.sample0:ch.sample1 + 1] - ch.token0)
                assert np.array_equal(ch["/samples/reward"], sf["/samples/reward"][ch.sample0:ch.sample1])
                for name in names[2:7]:
                    assert np.array_equal(ch[name], sf.read_slice(name, ch.token0, ch.token1)), name
                assert np.array_equal(ch["/train/updates/loss"], sf["/train/updates/loss"])
                seen = ch.sample1
            assert seen == sf.num_samples


def test_a_step_failing_half_way_is_skipped_whole(run, monkeypatch):
    """A chunk that cannot be read (a checksum failure deep in a step) skips that step and reports
    it; what the earlier chunks of the step folded in is undone."""
    from axrl.trace import CorruptStepError, chunks

    cfg = MismatchConfig.from_run_config(run.config, top_k=8, chunk_tokens=40)
    real = chunks.iter_chunks
    bad = run.steps[0]

    def failing(sf, *a, **kw):
        for ch in real(sf, *a, **kw):
            if sf.step == bad and ch.index == 2:
                raise CorruptStepError(f"{sf.path}: chunk 2 unreadable")
            yield ch

    monkeypatch.setattr(chunks, "iter_chunks", failing)
    reader = TraceReader(run.path)
    got = _read_steps(reader, reader.steps, cfg).result()
    assert [p.message for p in reader.problems] == [f"{reader.step_path(bad)}: chunk 2 unreadable"]
    monkeypatch.setattr(chunks, "iter_chunks", real)
    others = [s for s in run.steps if s != bad]
    assert json.dumps(got) == json.dumps(_read_steps(TraceReader(run.path), others, cfg).result())


def test_peak_memory_does_not_grow_with_the_step(tmp_path, monkeypatch):
    """mismatch over a step 4× longer (more samples) at a fixed chunk size: the same peak of traced
    allocations (numpy's included), within 20 % — the percentile buffers (4–8 bytes per analysed
    token) left out, as documented. (The peak is reached by the second chunk: the reused buffers
    and the previous chunk's arrays while the next is read.) The numpy path: the compiled one also
    holds the stored chunks it verifies, which grow with a small step up to the writer's 1 MiB."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import trace_scale

    monkeypatch.setattr(trace_scale, "SAMPLE_LEN", 2048)
    monkeypatch.setattr(trace_scale, "LAYERS", 8)
    peaks = []
    for samples in (16, 64):
        rec = trace_scale.synthetic_step(samples / trace_scale.SAMPLES)
        path = tmp_path / f"run{samples}"
        write_run(path, [rec], routing_encoding="packed")
        del rec
        reader = TraceReader(path)
        cfg = MismatchConfig(chunk_tokens=4096, keep_abs=False, compiled=False)
        _read_steps(reader, reader.steps, cfg)              # imports and caches outside the measure
        tracemalloc.start()
        _read_steps(reader, reader.steps, cfg).result()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0], peaks


@pytest.mark.parametrize("encoding", ["raw", "packed"])
def test_tui_routing_column_memory_does_not_grow_with_the_step(tmp_path, monkeypatch, encoding):
    """The TUI's per-sample routing column (``fill_routing``) of a step 4× longer at a fixed chunk
    size: the same peak of traced allocations within 20 % (the routing streamed a stored chunk at a
    time), and the figure the decoded columns give. Stored chunks of 16 KiB, so that every routing
    dataset's reach the writer's cap in both steps (at its 1 MiB the smaller step's marks and
    trainer rows would fit one smaller chunk), and steps of 32 and 128 samples: at 16 the agreement
    counts (``/routing/train_hits``, a byte per differing row) still fit chunks under the cap."""
    import sys

    from axrl.trace import writer

    sys.path.insert(0, str(ROOT / "bench"))
    import trace_scale

    from axrl_debug.tui import metrics

    monkeypatch.setattr(trace_scale, "SAMPLE_LEN", 2048)
    monkeypatch.setattr(trace_scale, "LAYERS", 8)
    monkeypatch.setattr(writer, "_CHUNK_BYTES", 1 << 14)
    peaks = []
    for samples in (32, 128):
        rec = trace_scale.synthetic_step(samples / trace_scale.SAMPLES)
        path = tmp_path / f"run{samples}"
        write_run(path, [rec], routing_encoding=encoding)
        del rec
        with StepFile(path / "trace" / "step_000000.h5") as sf:
            metrics.chunked_routing_agree(sf, 4096)             # imports and caches outside the measure
            tracemalloc.start()
            got = metrics.chunked_routing_agree(sf, 4096)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
            off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
            cols = sf.read_columns(metrics.SAMPLE_ROUTING_COLUMNS[:2], optional=metrics.SAMPLE_ROUTING_COLUMNS[2:])
            whole = metrics._routing_agree(off, cols, compiled=True)
        assert got.tobytes() == whole.tobytes() and 0.5 < float(got.mean()) < 1
    assert peaks[1] < 1.2 * peaks[0], peaks


def test_tui_opens_a_large_moe_step_without_its_routing_then_fills_it(run, monkeypatch):
    """The samples table from chunks is the whole-column one; above ``LAZY_ROUTING_TOKENS`` the
    routing column is left for ``fill_routing``, which gives the same values."""
    from axrl_debug.tui import data, metrics

    step = run.steps[-1]
    with run.open(step) as sf:
        cols = sf.read_columns(metrics.SAMPLE_STAT_COLUMNS, optional=metrics.SAMPLE_ROUTING_COLUMNS)
        whole = metrics.sample_stats(step, sf.policy_version, cols)
    eager = data.RunModel(run.path).step(step)
    monkeypatch.setattr(data, "LAZY_ROUTING_TOKENS", 0)
    lazy = data.RunModel(run.path).step(step)
    assert not eager.routing_pending and lazy.routing_pending
    assert np.isnan(lazy.stats.routing_agree).all()
    lazy.fill_routing()
    for model in (eager, lazy):
        for name in ("analysed", "mean_abs", "max_abs", "seq_log_ratio", "routing_agree"):
            assert np.array_equal(getattr(model.stats, name), getattr(whole, name), equal_nan=True), name
    assert math.isfinite(float(np.nanmean(lazy.stats.routing_agree)))


def test_row_ranges_verified_like_hdf5(tmp_path):
    """The compiled checksum path by row range (what chunked analysis reads): the rows HDF5 reads,
    and a flipped byte is a ChecksumError exactly when the range touches its chunk."""
    import h5py

    from axrl.trace.checksum import ChecksumError, read_rows_checksummed

    rng = np.random.default_rng(5)
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("f", data=rng.random(1000).astype(np.float32), chunks=(96,), fletcher32=True)
        f.create_dataset("r", data=rng.integers(0, 128, (333, 4, 8)).astype(np.uint8), chunks=(50, 4, 8),
                         fletcher32=True)
    raw = None
    with h5py.File(path, "r") as f:
        for name in ("f", "r"):
            ds = f[name]
            for a, b in [(0, 1), (0, ds.shape[0]), (95, 97), (130, 333 if name == "r" else 900), (ds.shape[0] - 1,
                                                                                              ds.shape[0])]:
                rows, raw = read_rows_checksummed(ds, a, b, raw)
                np.testing.assert_array_equal(rows, ds[a:b])
        info = f["r"].id.get_chunk_info(2)                        # rows 100..149
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 11)
        fh.write(bytes([fh.read(1)[0] ^ 0x10]))
    with h5py.File(path, "r") as f:
        rows, _ = read_rows_checksummed(f["r"], 0, 100, None)
        np.testing.assert_array_equal(rows, f["r"][0:100])
        with pytest.raises(ChecksumError, match="chunk 2"):
            read_rows_checksummed(f["r"], 120, 160, None)
