"""`axrl-debug mismatch` on packed routing compares the rollout and trainer expert sets from the
stored ``train_differs`` marks, decoding only the marked (token, layer) rows, and on raw routing
streams the stored rows a stored chunk at a time (``axrl/trace/routing_stream.py``,
``routing_pass``). Both must give the very report that decoding everything gives: per-layer
agreement and overlap, the routing class of every token (the ``routing_delta`` breakdown, the worst
tokens), every other figure — on steps whose trainer routing differs in many layers and samples,
including rows whose marks name a reordering of the same experts (agreeing sets), invalid rows, and
stored chunks smaller than a sample so that pieces and windows cross them. The TUI's per-sample
routing column (``fill_routing``) is computed on the same stream and held to the decoded figure
the same way, R3 and sharded steps included."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest

from axrl.trace import StepFile, TraceReader, routing_codec, writer
from axrl.trace.chunks import iter_chunks
from axrl_debug.analysis.mismatch import MismatchConfig, analyse, routing_agreement
from axrl_debug.analysis.mismatch.accumulator import _read_steps
from axrl_debug.synthetic import write_run
from test_trace import make_record

ROUTING = ["/routing/rollout", "/routing/train", "/routing/rollout_valid"]


def moe_record(step: int, experts: int, layers: int, k: int, valid: bool = True):
    """A ragged multi-sample step (``make_record``) with distinct top-k ids per row and a trainer
    that, on ~30 % of (token, layer) rows spread over every layer and sample, routes to the same
    experts in another order (marked, agreeing), swaps one expert, or picks k new ones."""
    rec = make_record(step, n_groups=4, group_size=4, mean_len=60)
    rng = np.random.default_rng(100 + step)
    t = rec.num_tokens
    rollout = np.argsort(rng.random((t, layers, experts)), axis=2)[:, :, :k].astype(routing_codec_dtype(experts))
    train = rollout.copy()
    kind = rng.choice(4, size=(t, layers), p=[0.7, 0.1, 0.1, 0.1])
    for ti, li in zip(*np.nonzero(kind == 1)):                  # same set, another order
        train[ti, li] = np.roll(rollout[ti, li], 1)
    for ti, li in zip(*np.nonzero(kind == 2)):                  # one expert swapped for an unused one
        unused = np.setdiff1d(np.arange(experts), rollout[ti, li])
        if unused.size:
            train[ti, li, rng.integers(k)] = rng.choice(unused)
    for ti, li in zip(*np.nonzero(kind == 3)):                  # another set altogether
        train[ti, li] = np.argsort(rng.random(experts))[:k]
    pool = rec.pool_routing_rollout
    return replace(rec, num_experts=experts, routing_rollout=rollout, routing_train=train,
                   routing_rollout_valid=rec.routing_rollout_valid if valid else None,
                   pool_routing_rollout=None if pool is None else np.asarray(pool) % experts)


def routing_codec_dtype(experts: int) -> type:
    return np.uint8 if experts <= 256 else np.uint16


@pytest.fixture(scope="module", params=[(128, 10, 8, True), (128, 10, 8, False), (6, 3, 2, True), (256, 9, 8, True),
                                        (64, 70, 3, True), (300, 4, 4, True)],
                ids=lambda p: "E{}-L{}-k{}{}".format(*p[:3], "" if p[3] else "-no-valid"))
def runs(request, tmp_path_factory):
    """The same two steps stored raw and packed, in stored chunks of 2 KiB (many per sample)."""
    experts, layers, k, valid = request.param
    records = [moe_record(s, experts, layers, k, valid) for s in range(2)]
    root = tmp_path_factory.mktemp("stream")
    mp = pytest.MonkeyPatch()
    mp.setattr(writer, "_CHUNK_BYTES", 2048)
    try:
        write_run(root / "raw", records)
        write_run(root / "packed", records, routing_encoding="packed")
    finally:
        mp.undo()
    return request.param, TraceReader(root / "raw"), TraceReader(root / "packed")


@pytest.mark.parametrize("chunk_tokens", [100, 1 << 18])
def test_streamed_routing_is_the_decoded_answer(runs, chunk_tokens):
    """Packed (marks) and raw (stored rows) streams give, bit for bit, the report of the same
    compiled analysis on the decoded whole columns, and the routing figures of the numpy
    reference (``routing_agreement``) over every row."""
    (experts, layers, k, _), raw, packed = runs
    cfg = MismatchConfig.from_run_config(raw.config, top_k=40, compiled=True, chunk_tokens=chunk_tokens)
    required, optional = cfg.columns()
    whole = analyse(raw.iter_columns(required, optional=optional), cfg).result()
    for reader in (packed, raw):
        with reader.open(reader.steps[0]) as sf:
            ch = next(iter_chunks(sf, required + ROUTING[:2], stream_routing=True))
            assert ch.routing is not None and ch.routing.packed == (reader is packed)
            assert "/routing/rollout" not in ch.data
        got = _read_steps(reader, reader.steps, cfg).result()
        got.pop("run", None)
        assert json.dumps(got) == json.dumps(whole), reader.path.name
    assert [t["routing"] for t in whole["top"]].count("differs") > 0
    rows = agree = hits = 0
    for step in raw.steps:
        with raw.open(step) as sf:
            valid = np.asarray(sf.get("/routing/rollout_valid", np.ones(sf.num_tokens))) != 0
            _, layer_agree, layer_hits = routing_agreement(sf["/routing/rollout"], sf["/routing/train"], valid)
            rows, agree, hits = rows + int(valid.sum()), agree + layer_agree, hits + layer_hits
    assert [x["agreement"] for x in whole["routing"]["layers"]] == [float(a) / rows for a in agree]
    assert [x["overlap"] for x in whole["routing"]["layers"]] == [float(h) / (rows * k) for h in hits]
    assert 0.5 < whole["routing"]["agreement"] < 0.95
    # the numpy path (set comparison in numpy): the same routing counts and token routing classes
    numpy = analyse(raw.iter_columns(required, optional=optional), replace(cfg, compiled=False)).result()
    assert numpy["routing"]["layers"] == whole["routing"]["layers"]
    assert [(b["bucket"], b["count"]) for b in numpy["routing"]["delta"]] == \
        [(b["bucket"], b["count"]) for b in whole["routing"]["delta"]]
    assert [(t["token"], t["routing"]) for t in numpy["top"]] == [(t["token"], t["routing"]) for t in whole["top"]]


def test_step_table_streams_alike(runs):
    """summary / spikes / check: the compiled step table streams the routing too — the same table
    from raw and packed steps, its routing agreement the decoded whole columns'."""
    import pandas as pd

    from axrl_debug.analysis import frames

    _, raw, packed = runs
    cfg = MismatchConfig.from_run_config(raw.config, compiled=True)
    table = frames.step_table(raw, cfg=cfg)
    pd.testing.assert_frame_equal(table, frames.step_table(packed, cfg=cfg), check_exact=True)
    required, optional = cfg.columns()
    whole = analyse(raw.iter_columns(required, optional=optional), cfg).result()
    assert table["routing_agreement"].tolist() == [h["routing_agreement"] for h in whole["per_step"]]


def test_marks_name_agreeing_reorderings(runs):
    """The packed steps mark more rows than disagree: reordered sets are marked but agree, and
    the stream counts them as agreeing (covered by the comparison above)."""
    _, raw, packed = runs
    cfg = MismatchConfig.from_run_config(raw.config, compiled=True)
    res = _read_steps(packed, packed.steps, cfg).result()
    disagree = sum(round((1 - x["agreement"]) * x["rows"]) for x in res["routing"]["layers"])
    marked = 0
    for step in packed.steps:
        with packed.open(step) as sf:
            marked += int(routing_codec.popcount_rows(sf._f["/routing/train_differs"][()]).sum())
    assert marked > disagree > 0


def test_numpy_path_decodes_a_stream(runs):
    """A stream handed to the numpy path is decoded (``routing_arrays``): the numpy path's report."""
    _, raw, packed = runs
    cfg = MismatchConfig.from_run_config(raw.config, top_k=12, compiled=False, chunk_tokens=100)
    required, optional = cfg.columns()
    acc = _read_steps(raw, raw.steps, cfg)
    from axrl_debug.analysis.mismatch import MismatchAccumulator

    streamed = MismatchAccumulator(cfg)
    for step in packed.steps:
        with packed.open(step) as sf:
            streamed.add_chunks(sf.step, sf.policy_version, iter_chunks(sf, required, optional=optional,
                                chunk_tokens=100, stream_routing=True), sf.num_tokens)
    assert json.dumps(streamed.result()) == json.dumps(acc.result())


def _r3_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two R3 steps written raw (tmp_path/raw) and packed (tmp_path/packed): the trainer routing is
    the rollout's, its invalid rows zeroed as the rollout's are stored on step 0 and kept on step 1
    (marked there). Returns the list the routing stream appends each dataset name it reads rows of."""
    from axrl.trace import routing_stream

    records = [moe_record(s, 128, 10, 8) for s in range(2)]
    for i, r in enumerate(records):
        invalid = np.asarray(r.routing_rollout_valid) == 0
        train = r.routing_rollout.copy()
        if i == 0:
            train[invalid] = 0     # as stored: the rollout's invalid rows are zeros
        records[i] = replace(r, routing_train=train)
    write_run(tmp_path / "raw", records)
    write_run(tmp_path / "packed", records, routing_encoding="packed")
    read: list[str] = []
    real = routing_stream._Rows.rows
    monkeypatch.setattr(routing_stream._Rows, "rows", lambda self, a, b: (read.append(self.name), real(self, a, b))[1])
    return read


def test_r3_steps_read_no_rollout_rows(tmp_path, monkeypatch):
    """Trainer routing equal to the rollout's (R3): the packed comparison reads the marks only —
    not one stored rollout row, even where the rows never fed to the model are marked (they are
    stored as zeros for the rollout only) — and reports full agreement, as decoding everything does."""
    read = _r3_runs(tmp_path, monkeypatch)
    cfg = MismatchConfig(compiled=True, top_k=20, chunk_tokens=100)
    packed = _read_steps(TraceReader(tmp_path / "packed"), [0, 1], cfg).result()
    assert "/routing/rollout_packed" not in read and "/routing/train_differs" in read
    raw = TraceReader(tmp_path / "raw")
    required, optional = cfg.columns()
    whole = analyse(raw.iter_columns(required, optional=optional), cfg).result()
    packed.pop("run", None)
    assert json.dumps(packed) == json.dumps(whole) and whole["routing"]["agreement"] == 1.0
    with StepFile(tmp_path / "packed" / "trace" / "step_000001.h5") as sf:
        assert sf._f["/routing/train_rows"].shape[0] > 0          # the invalid rows' marks


def test_marks_without_stored_rows_drop_the_step(tmp_path):
    """A packed step whose trainer rows are fewer than its marks name is reported, not analysed;
    the other step still is."""
    records = [moe_record(s, 128, 10, 8) for s in range(2)]
    write_run(tmp_path / "run", records, routing_encoding="packed")
    bad = tmp_path / "run" / "trace" / "step_000001.h5"
    with h5py.File(bad, "r+") as f:
        rows = f["/routing/train_rows"][()]
        del f["/routing/train_rows"]
        f.create_dataset("/routing/train_rows", data=rows[:-5])
    reader = TraceReader(tmp_path / "run")
    res = _read_steps(reader, reader.steps, MismatchConfig(compiled=True)).result()
    assert res["steps"] == [0]
    assert len(reader.problems) == 1 and str(bad) in reader.problems[0].message
    assert "train_rows" in reader.problems[0].message or "trainer routing rows" in reader.problems[0].message
    with StepFile(bad) as sf:
        with pytest.raises(Exception):
            sf["/routing/train"]


def _decoded_sample_agree(sf) -> np.ndarray:
    """The TUI's per-sample routing agreement from the decoded whole columns, the numpy set
    comparison (``sample_stats``'s) — checked equal to the compiled rows' first."""
    from axrl_debug.tui import metrics

    off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
    cols = sf.read_columns(ROUTING[:2], optional=ROUTING[2:])
    ref = metrics._routing_agree(off, cols)
    assert ref.tobytes() == metrics._routing_agree(off, cols, compiled=True).tobytes()
    return ref


def _streamed_sample_agree(sf, chunk_tokens: int | None, monkeypatch) -> np.ndarray:
    """``chunked_routing_agree`` (the TUI's ``fill_routing``), which must take the stream: the
    decoding path refuses to run."""
    from axrl_debug.tui import metrics

    with monkeypatch.context() as m:
        m.setattr(metrics, "_routing_agree", lambda *a, **k: pytest.fail("the routing pair was decoded"))
        return metrics.chunked_routing_agree(sf, chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [100, None])
def test_tui_routing_column_streams_alike(runs, chunk_tokens, monkeypatch):
    """The TUI's per-sample routing agreement (``fill_routing`` → ``chunked_routing_agree``) on the
    routing streamed as stored, raw and packed, in stored chunks smaller than a sample: byte for
    byte the figure of the decoded whole columns — invalid rows left out (their trainer routing
    differs too), marked reorderings agreeing."""
    (experts, layers, k, valid), raw, packed = runs
    for step in raw.steps:
        with raw.open(step) as sf:
            ref = _decoded_sample_agree(sf)
            if valid:       # some samples hold invalid rows, which would change the figure if counted
                v = np.asarray(sf["/routing/rollout_valid"]) != 0
                assert not v.all()
        assert np.isfinite(ref).any() and (ref[np.isfinite(ref)] < 1).any()
        for reader in (raw, packed):
            with reader.open(step) as sf:
                got = _streamed_sample_agree(sf, chunk_tokens, monkeypatch)
            assert got.tobytes() == ref.tobytes(), (reader.path.name, step)


def test_tui_routing_column_of_r3_steps_reads_no_rollout_rows(tmp_path, monkeypatch):
    """R3 (the trainer routes as the engine: no valid row marked; the invalid rows' marks only, on
    one step not even those): every sample agrees fully, as decoding says, and the packed step's
    rollout rows are never read."""
    read = _r3_runs(tmp_path, monkeypatch)
    for step in (0, 1):
        with StepFile(tmp_path / "raw" / "trace" / f"step_{step:06d}.h5") as sf:
            ref = _decoded_sample_agree(sf)
        assert set(ref[np.isfinite(ref)].tolist()) == {1.0}
        for name in ("packed", "raw"):
            with StepFile(tmp_path / name / "trace" / f"step_{step:06d}.h5") as sf:
                assert _streamed_sample_agree(sf, 100, monkeypatch).tobytes() == ref.tobytes()
            if name == "packed":
                assert "/routing/rollout_packed" not in read and "/routing/train_differs" in read


@pytest.mark.parametrize("encoding", ["raw", "packed"])
def test_tui_routing_column_of_sharded_steps(tmp_path, encoding, monkeypatch):
    """A sharded step (routing rows in shard files behind virtual datasets) streams to the figure of
    the same step unsharded, decoded."""
    from test_trace_shards import write_sharded

    rec = moe_record(0, 128, 10, 8)
    write_run(tmp_path / "plain", [rec])
    with StepFile(tmp_path / "plain" / "trace" / "step_000000.h5") as sf:
        ref = _decoded_sample_agree(sf)
    (tmp_path / "sharded").mkdir()
    path = write_sharded(tmp_path / "sharded", rec, [3, 9], encoding)
    with StepFile(path) as sf:
        assert sf.shards
        got = _streamed_sample_agree(sf, 100, monkeypatch)
    assert got.tobytes() == ref.tobytes()


def test_tui_routing_column_of_a_damaged_packed_step_is_an_error(tmp_path):
    """Marks naming more trainer rows than are stored: the TUI's routing column raises
    ``CorruptStepError`` naming the step file (the samples screen shows it as a warning), never a
    column read from the wrong rows."""
    from axrl.trace import CorruptStepError
    from axrl_debug.tui import metrics

    write_run(tmp_path / "run", [moe_record(0, 128, 10, 8)], routing_encoding="packed")
    bad = tmp_path / "run" / "trace" / "step_000000.h5"
    with h5py.File(bad, "r+") as f:
        rows = f["/routing/train_rows"][()]
        del f["/routing/train_rows"]
        f.create_dataset("/routing/train_rows", data=rows[:-5])
    with StepFile(bad) as sf:
        with pytest.raises(CorruptStepError, match=str(bad)):
            metrics.chunked_routing_agree(sf)


def _recorded_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the stored routing datasets the stream reads rows of, as it reads them."""
    from axrl.trace import routing_stream

    read: list[str] = []
    real = routing_stream._Rows.rows
    monkeypatch.setattr(routing_stream._Rows, "rows", lambda self, a, b: (read.append(self.name), real(self, a, b))[1])
    return read


def test_packed_agreement_is_read_from_train_hits_and_old_files_still_analyse(tmp_path, monkeypatch):
    """Packed steps store each marked row's |A ∩ B| (``/routing/train_hits``): the analysis counts
    the agreement from the marks and those bytes, reading no rollout or trainer routing row, and
    reports what decoding everything does. A packed file written before ``train_hits`` existed
    (the dataset deleted) is still analysed — by decoding the marked rows — to the same report."""
    records = [moe_record(s, 128, 10, 8) for s in range(2)]
    write_run(tmp_path / "raw", records)
    write_run(tmp_path / "packed", records, routing_encoding="packed")
    write_run(tmp_path / "old", records, routing_encoding="packed")
    for step in (0, 1):
        with h5py.File(tmp_path / "old" / "trace" / f"step_{step:06d}.h5", "r+") as f:
            assert f["/routing/train_hits"].shape == f["/routing/train_rows"].shape[:1]
            del f["/routing/train_hits"]
    cfg = MismatchConfig(compiled=True, top_k=20, chunk_tokens=100)
    raw = TraceReader(tmp_path / "raw")
    required, optional = cfg.columns()
    whole = analyse(raw.iter_columns(required, optional=optional), cfg).result()
    assert 0.5 < whole["routing"]["agreement"] < 0.95
    read = _recorded_reads(monkeypatch)
    for name in ("packed", "old"):
        read.clear()
        got = _read_steps(TraceReader(tmp_path / name), [0, 1], cfg).result()
        got.pop("run", None)
        assert json.dumps(got) == json.dumps(whole), name
        decoded = {"/routing/rollout_packed", "/routing/train_rows"} & set(read)
        assert decoded == (set() if name == "packed" else {"/routing/rollout_packed", "/routing/train_rows"}), name
    with StepFile(tmp_path / "old" / "trace" / "step_000001.h5") as sf:   # the reader: as before
        assert np.array_equal(sf["/routing/train"], records[1].routing_train)
