"""Packed routing (trace.routing_encoding: packed): the codec round-trips every shape exactly, and a
packed step file reads back as the very arrays a raw one holds — whole, by token range, by column —
so every analysis gives the same answer on both."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from axrl.trace import StepFile, routing_codec, write_step
from axrl_debug.cli import app
from axrl_debug.synthetic import write_run
from test_trace import make_record


def reference_pack(ids: np.ndarray, bits: int) -> np.ndarray:
    """An independent bit-by-bit packer of the documented layout: per row a little-endian bit
    stream, id j at bits [j·b, (j+1)·b), zero-padded to ⌈n / 8⌉·b bytes (b ≤ 8) or ⌈n·b / 8⌉."""
    rows = ids.reshape(ids.shape[0], -1)
    n = rows.shape[1]
    width = -(-n // 8) * bits if bits <= 8 else -(-n * bits // 8)
    out = np.zeros((rows.shape[0], width), np.uint8)
    for t, row in enumerate(rows):
        for j, v in enumerate(row.tolist()):
            for bit in range(bits):
                if (v >> bit) & 1:
                    out[t, (j * bits + bit) // 8] |= 1 << ((j * bits + bit) % 8)
    return out


@pytest.mark.parametrize("experts,layers,k", [(2, 3, 1), (128, 4, 8), (256, 5, 8), (100, 4, 3), (60, 48, 8),
                                              (1000, 2, 8), (300, 7, 1)])
@pytest.mark.parametrize("agree", [0.0, 0.9, 1.0])
def test_codec_round_trips(experts: int, layers: int, k: int, agree: float) -> None:
    rng = np.random.default_rng(experts + layers)
    dtype = np.uint8 if experts <= 256 else np.uint16
    rollout = rng.integers(0, experts, (301, layers, k)).astype(dtype)
    rollout[0] = experts - 1                                   # the largest id, every bit set
    train = rollout.copy()
    differs = rng.random((301, layers)) >= agree
    train[differs] = rng.integers(0, experts, (int(differs.sum()), k))
    bits = routing_codec.bits_for(experts)
    packed = routing_codec.pack_ids(rollout, bits)
    assert np.array_equal(packed[:40], reference_pack(rollout[:40], bits))
    assert np.array_equal(routing_codec.unpack_ids(packed, bits, (layers, k), dtype), rollout)
    mask, rows, hits = routing_codec.encode_train(train, rollout, bits)
    marked = (train != rollout).any(axis=2)
    assert rows.shape[0] == hits.shape[0] == int(marked.sum())
    a, b = rollout[marked], train[marked]   # |A ∩ B| of each marked row: Σ_i [a_i ∈ B]
    assert hits.tolist() == [sum(int(x in set(y.tolist())) for x in r.tolist()) for r, y in zip(a, b)]
    assert np.array_equal(routing_codec.decode_train(rollout, mask, rows, bits), train)


@pytest.mark.parametrize("experts,layers,k", [(2, 3, 1), (128, 4, 8), (256, 5, 8), (100, 9, 3), (60, 48, 8)])
def test_compiled_packing_writes_the_same_bytes(experts: int, layers: int, k: int) -> None:
    """The writer's compiled packing of large steps (routing_kernels) stores byte for byte what
    the reference codec does, so files written either way read the same (old ones included)."""
    from axrl.trace.writer import _encode_train, _pack

    rng = np.random.default_rng(experts * layers)
    rollout = rng.integers(0, experts, (257, layers, k)).astype(np.uint8)
    train = rollout.copy()
    differs = rng.random((257, layers)) < 0.3
    train[differs] = rng.integers(0, experts, (int(differs.sum()), k))
    train[0, 0] = rollout[0, 0, ::-1]                          # same set, another order: differs, k hits
    bits = routing_codec.bits_for(experts)
    assert np.array_equal(_pack(rollout, bits, True), routing_codec.pack_ids(rollout, bits))
    for got, want in zip(_encode_train(train, rollout, bits, True), routing_codec.encode_train(train, rollout, bits)):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_packed_bytes_per_token_layer() -> None:
    """At top-8 of 128 experts: 7 bytes for the engine's ids (vs 8), the trainer's ≈ 0.1 × (7 + 1)
    + 1/8 when 90 % of (token, layer) rows agree (vs 8): rows, their |A ∩ B| counts, the marks."""
    rng = np.random.default_rng(0)
    rollout = rng.integers(0, 128, (2000, 48, 8)).astype(np.uint8)
    train = rollout.copy()
    differs = rng.random((2000, 48)) < 0.1
    train[differs] = rng.integers(0, 128, (int(differs.sum()), 8))
    packed = routing_codec.pack_ids(rollout, 7)
    mask, rows, hits = routing_codec.encode_train(train, rollout, 7)
    assert packed.nbytes / (2000 * 48) == 7
    assert (mask.nbytes + rows.nbytes + hits.nbytes) / (2000 * 48) == pytest.approx(0.1 * 8 + 1 / 8, abs=0.05)


def test_packed_step_file_reads_as_raw(tmp_path) -> None:
    rec = make_record(step=3, num_experts=60, num_layers=5, topk=4)
    with StepFile(write_step(tmp_path / "raw", rec)) as raw, \
            StepFile(write_step(tmp_path / "packed", rec, routing_encoding="packed")) as packed:
        assert "/routing/rollout_packed" in packed._f and "/routing/rollout" not in packed._f
        assert raw.keys() == packed.keys()
        for name in ("/routing/rollout", "/routing/train"):
            assert name in packed
            full = raw[name]
            assert packed[name].dtype == full.dtype and np.array_equal(packed[name], full)
            for a, b in ((0, 1), (17, 90), (90, full.shape[0]), (5, 5)):
                assert np.array_equal(packed.read_slice(name, a, b), full[a:b]), (name, a, b)
        cols = packed.read_columns(["/routing/rollout", "/routing/train", "/tokens/ids"], buffers={})
        assert np.array_equal(cols["/routing/train"], raw["/routing/train"])
        back = packed.to_record()
        assert np.array_equal(back.routing_train, rec.routing_train) and back.num_experts == 60
    with pytest.raises(ValueError, match="routing_encoding"):
        write_step(tmp_path / "x", rec, routing_encoding="zip")


def test_packed_routing_is_compressed_and_earlier_files_still_read(tmp_path) -> None:
    """The packed datasets are gzip-compressed: routing that repeats (a group's samples share their
    prompt) stores far below its bit-packed size, uniform routing at it; and a packed file of the
    earlier layout (the same datasets stored raw) reads back as the same arrays."""
    from axrl.trace.writer import RAW_DATASETS

    rec = make_record(step=1, num_experts=64, num_layers=6, topk=4, n_groups=4, group_size=8, mean_len=200)
    off = np.asarray(rec.sample_offsets)
    repeated = np.asarray(rec.routing_rollout).copy()
    for g in range(4):                      # every sample of a group routed like its first one
        first = off[g * 8]
        for i in range(g * 8 + 1, g * 8 + 8):
            n = min(off[i + 1] - off[i], off[g * 8 + 1] - first)
            repeated[off[i]:off[i] + n] = repeated[first:first + n]
    rec.routing_rollout, rec.routing_train = repeated, repeated.copy()
    packed = {"/routing/rollout_packed", "/routing/train_differs", "/routing/train_rows"}
    now = write_step(tmp_path / "now", rec, routing_encoding="packed")
    before = write_step(tmp_path / "before", rec, routing_encoding="packed", raw=RAW_DATASETS | packed)
    raw = write_step(tmp_path / "raw", rec)
    with StepFile(now) as a, StepFile(before) as b, StepFile(raw) as r:
        stored = a._f["/routing/rollout_packed"]
        assert stored.compression == "gzip" and stored.fletcher32
        assert b._f["/routing/rollout_packed"].compression is None
        assert stored.id.get_storage_size() < 0.5 * b._f["/routing/rollout_packed"].id.get_storage_size()
        for name in ("/routing/rollout", "/routing/train"):
            assert np.array_equal(a[name], b[name]) and np.array_equal(a[name], r[name])
            assert np.array_equal(a.read_slice(name, 40, 300), b.read_slice(name, 40, 300))
    write_run(tmp_path / "r_now", [rec], routing_encoding="packed")
    write_run(tmp_path / "r_raw", [rec])
    out = [json.loads(CliRunner().invoke(app, ["mismatch", str(tmp_path / d), "--json"]).stdout) for d in ("r_now", "r_raw")]
    for o in out:
        o.pop("run", None)
    assert out[0] == out[1]


def test_analyses_agree_on_packed_and_raw_runs(tmp_path) -> None:
    records = [make_record(step=s, num_experts=64, num_layers=6, topk=4) for s in range(3)]
    write_run(tmp_path / "raw", records)
    write_run(tmp_path / "packed", records, routing_encoding="packed")
    run = CliRunner()
    for command in (["mismatch", "--json"], ["summary", "--json"]):
        out = [json.loads(run.invoke(app, [command[0], str(tmp_path / d), *command[1:]]).stdout) for d in ("raw", "packed")]
        for o in out:
            o.pop("run", None)
        assert out[0] == out[1], command


def test_train_with_packed_routing_replays_bitwise(tmp_path) -> None:
    """`axrl train --set trace.routing_encoding=packed` on a MoE model: the files hold the packed
    datasets, and `axrl-debug replay` (which re-runs the trainer with the recorded routing) is
    bitwise, as on a raw run."""
    from axrl.cli import app as axrl_app
    from test_replay import QUICKSTART, RUN_SETTINGS, replay_json

    run = tmp_path / "run"
    args = ["train", str(QUICKSTART), "--run-dir", str(run)]
    for s in [*RUN_SETTINGS, "steps=2", "trace.routing_encoding=packed", "r3=true"]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    with StepFile(run / "trace" / "step_000001.h5") as sf:
        assert "/routing/rollout_packed" in sf._f and sf["/routing/train"].shape == sf["/routing/rollout"].shape
    code, doc = replay_json(run, "--step", 1)
    assert code == 0 and doc["verdict"] == "bitwise-equal", doc["first_divergence"]


def test_trace_scale_bench_runs_small() -> None:
    """bench/trace_scale.py at a tiny scale: its last line carries the issue's keys, and the packed
    encoding stores the routing in about half the bytes of the raw one."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "trace_scale.py"
    out = subprocess.run([sys.executable, str(bench), "--scales", "0.005"], check=True, capture_output=True, text=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("record_critical_path_fraction", "writer_keeps_up", "routing_bytes_per_token_layer",
                "analysis_tokens_per_s", "analysis_peak_rss_gb", "tui_open_s", "scaling",
                "analysis_routing_ids_per_s", "analysis_startup_s", "analysis_first_step_s",
                "analysis_tokens_per_s_r3", "routing_bytes_over_entropy", "analysis_bytes_per_s",
                "analysis_over_step", "in_step_s", "tui_routing_s", "tui_routing_all_s"):
        assert key in summary, key
    by = {r["encoding"]: r for r in summary["by_scale"]}
    assert by["raw"]["routing_bytes_per_token_layer"] == pytest.approx(16, rel=0.01)
    assert by["packed"]["routing_bytes_per_token_layer"] < 8
