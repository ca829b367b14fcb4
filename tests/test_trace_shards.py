"""Sharded steps (axrl/trace/shards.py): rows written by several processes into shard files plus a
small index, read exactly as an unsharded step; a killed write never leaves a half step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from axrl.trace import CorruptStepError, RunDir, StepFile, TraceReader, read_step
from axrl.trace import schema as S
from axrl.trace.prepare import prepare
from axrl.trace.shards import routing_rows, shard_dir, write_shard, write_sharded_step
from test_trace import assert_records_equal, make_record

ROOT = Path(__file__).resolve().parents[1]


def write_sharded(trace_dir: Path, rec, cuts: list[int], encoding: str = "raw", overwrite: bool = False) -> Path:
    """Write `rec` as a sharded step as the train ranks and the learner do: its samples split at
    `cuts`, each share's routing rows converted (`routing_rows`) and written as a shard, the rest
    in the index."""
    off = np.asarray(rec.sample_offsets)
    bounds = [0, *cuts, len(off) - 1]
    infos = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        a, b = int(off[lo]), int(off[hi])
        rows, attrs = routing_rows(np.asarray(rec.routing_rollout)[a:b], np.asarray(rec.routing_train)[a:b],
                                   off[lo:hi + 1] - a, rec.num_experts, encoding)
        infos.append(write_shard(trace_dir, rec.step, f"train_rank{i}", a, b, rows, attrs))
    rest = rec.__class__(**{**rec.__dict__, "routing_rollout": None, "routing_train": None,
                            "routing_rollout_valid": None})
    return write_sharded_step(trace_dir, rest, infos, overwrite=overwrite)


@pytest.mark.parametrize("encoding", ["raw", "packed"])
def test_sharded_step_reads_as_the_unsharded_one(tmp_path, encoding):
    rec = make_record(3, n_groups=3, group_size=3)
    plain = RunDir(tmp_path / "plain").write_step(rec, routing_encoding=encoding)
    run = RunDir(tmp_path / "sharded")
    sharded = write_sharded(run.trace_dir, rec, [2, 5], encoding)
    assert sorted(p.name for p in shard_dir(run.trace_dir, 3).iterdir()) == [
        "train_rank0.h5", "train_rank1.h5", "train_rank2.h5"]
    a, b = read_step(plain), read_step(sharded)
    assert a.keys() == b.keys()
    for k in a:
        if k not in ("attrs", "group_attrs"):
            assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() or \
                np.asarray(a[k]).tolist() == np.asarray(b[k]).tolist(), k
    assert a["group_attrs"] == b["group_attrs"]
    assert {k: v for k, v in a["attrs"].items() if k != S.ATTR_CREATED_UNIX} == \
        {k: v for k, v in b["attrs"].items() if k not in (S.ATTR_CREATED_UNIX, S.ATTR_SHARD_FILES)}
    with StepFile(sharded) as sf:
        assert_records_equal(sf.to_record(), rec)
        assert S.ATTR_SHARD_FILES not in sf.to_record().attrs
        off = sf["/samples/offsets"]
        i = 4   # a sample whose rows straddle no shard boundary, read as one slice
        np.testing.assert_array_equal(sf.read_slice("/routing/train", off[i], off[i + 1]),
                                      np.asarray(rec.routing_train)[off[i]:off[i + 1]])
        b = int(off[2])   # a slice across the first shard boundary (packed: the trainer's rows of both)
        np.testing.assert_array_equal(sf.read_slice("/routing/train", b - 5, b + 5),
                                      np.asarray(rec.routing_train)[b - 5:b + 5])
        stored = "/routing/rollout_packed" if encoding == "packed" else "/routing/rollout"
        assert sf._f[stored].is_virtual
        buffers: dict = {}
        cols = sf.read_columns(["/routing/rollout", "/tokens/old_logprob"], buffers=buffers, fast_checksums=True)
        np.testing.assert_array_equal(cols["/routing/rollout"], a["/routing/rollout"])
    # the index holds no routing rows of its own: the payload is in the shards
    assert sharded.stat().st_size < plain.stat().st_size
    reader = TraceReader(run.path)
    assert reader.steps == [3] and reader.problems == []


def test_run_dir_moved_whole_still_reads(tmp_path):
    rec = make_record(0)
    run = RunDir(tmp_path / "a")
    write_sharded(run.trace_dir, rec, [5])
    (tmp_path / "a").rename(tmp_path / "b")
    with TraceReader(tmp_path / "b").open(0) as sf:
        np.testing.assert_array_equal(sf["/routing/train"], np.asarray(rec.routing_train))


def test_missing_or_foreign_shard_is_refused_naming_it(tmp_path):
    rec = make_record(1)
    run = RunDir(tmp_path / "run")
    write_sharded(run.trace_dir, rec, [4])
    shard = shard_dir(run.trace_dir, 1) / "train_rank1.h5"
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(CorruptStepError, match="train_rank1.h5"):
        StepFile(run.step_path(1))
    reader = TraceReader(run.path)
    assert reader.steps == [] and "train_rank1.h5" in str(reader.problems[0])
    shard.write_bytes(data[: len(data) // 2])   # truncated
    reader.refresh()
    assert reader.steps == [] and "train_rank1.h5" in str(reader.problems[0])


def test_shards_must_cover_the_step_once(tmp_path):
    rec = make_record(0)
    p = prepare(rec)
    rows = p.datasets["/routing/train"]
    half = write_shard(tmp_path, 0, "a", 0, 10, {"/routing/train": rows[:10]})
    rest = rec.__class__(**{**rec.__dict__, "routing_train": None})
    with pytest.raises(ValueError, match="cover 10 token rows"):
        write_sharded_step(tmp_path, rest, [half])
    gap = write_shard(tmp_path, 0, "b", 12, len(rows), {"/routing/train": rows[12:]})
    with pytest.raises(ValueError, match="starts at row 12, expected 10"):
        write_sharded_step(tmp_path, rest, [half, gap])
    assert not (tmp_path / S.step_file_name(0)).exists()


def test_routing_rows_store_what_the_step_file_stores():
    """A rank's rows (int64 ids as the trainer returns them) come out as prepare() stores them."""
    rng = np.random.default_rng(0)
    off = np.array([0, 3, 7, 8])
    rollout, train = rng.integers(0, 8, (8, 2, 2)), rng.integers(0, 8, (8, 2, 2))
    out, attrs = routing_rows(rollout, train, off, 8)
    assert attrs == {S.ROUTING_ATTR_NUM_EXPERTS: 8}
    assert out["/routing/rollout"].dtype == np.uint8 and out["/routing/train"].dtype == np.uint8
    np.testing.assert_array_equal(out["/routing/rollout_valid"], [1, 1, 0, 1, 1, 1, 0, 0])
    assert not out["/routing/rollout"][[2, 6, 7]].any() and rollout[2].any()   # the caller's array untouched
    np.testing.assert_array_equal(out["/routing/train"], train)
    with pytest.raises(ValueError, match="num_experts=4"):
        routing_rows(rollout, None, off, 4)


KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from pathlib import Path
    import axrl.trace.writer as W
    from test_trace_shards import write_sharded
    from test_trace import make_record
    fill = W._write_h5
    calls = []
    def killing(f, p, *a):
        calls.append(1)
        if len(calls) == {kill_at}:   # this file half written: the process dies as by SIGKILL
            f.create_dataset("half", data=[1, 2, 3]); f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return fill(f, p, *a)
    W._write_h5 = killing
    import axrl.trace.shards as SH
    SH._write_h5 = killing
    write_sharded(Path({trace!r}), make_record(1), [4, 9])
""")


@pytest.mark.parametrize("kill_at", [2, 4])   # during the second shard; during the index
def test_killed_shard_or_index_write_leaves_no_half_step(tmp_path, kill_at):
    run = RunDir(tmp_path / "run")
    run.write_manifest(seed=0)
    write_sharded(run.trace_dir, make_record(0), [4])
    script = KILLED_WRITE.format(root=str(ROOT), tests=str(ROOT / "tests"), trace=str(run.trace_dir),
                                 kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert run.completed_steps() == [0]
    reader = TraceReader(run.path)
    assert reader.steps == [0] and reader.problems == []
    assert shard_dir(run.trace_dir, 1).is_dir()              # shards (or a tmp) of the dead step
    removed = run.clean_tmp()
    assert shard_dir(run.trace_dir, 1) in removed and not shard_dir(run.trace_dir, 1).exists()
    assert run.tmp_files() == [] and shard_dir(run.trace_dir, 0).is_dir()
    write_sharded(run.trace_dir, make_record(1), [4, 9])    # the step written again, whole
    assert TraceReader(run.path).steps == [0, 1]


PROMOTION_KILLED = KILLED_WRITE.replace("write_sharded(Path({trace!r}), make_record(1), [4, 9])", """
import dataclasses
rec = make_record(1)
full = dataclasses.replace(rec, attrs={{**rec.attrs, "trace_level": "full", "trace_promoted_by": 2}})
write_sharded(Path({trace!r}), full, [4, 9], overwrite=True)""")


@pytest.mark.parametrize("kill_at", [2, 4])   # during the second shard; during the full index
def test_killed_promotion_leaves_the_reduced_step_whole(tmp_path, kill_at):
    """A spike's promotion of a ring step rewrites a step that is on disk reduced: killed half
    way, the step reads as it was (level standard, whole), and a later promotion replaces it."""
    from axrl.runtime.recording.tiers import TierSettings, reduce_record

    run = RunDir(tmp_path / "run")
    run.write_manifest(seed=0)
    run.write_step(reduce_record(make_record(1), TierSettings("standard", routing_every=2)))
    script = PROMOTION_KILLED.format(root=str(ROOT), tests=str(ROOT / "tests"), trace=str(run.trace_dir),
                                     kill_at=kill_at)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    reader = TraceReader(run.path)
    assert reader.steps == [1] and reader.problems == []
    with reader.open(1) as sf:
        assert sf.attrs["trace_level"] == "standard" and "/routing/train" not in sf and not sf.shards
    run.clean_tmp()
    assert run.tmp_files() == []
    import dataclasses
    rec = make_record(1)
    write_sharded(run.trace_dir, dataclasses.replace(rec, attrs={**rec.attrs, "trace_level": "full"}), [4, 9],
                  overwrite=True)
    with TraceReader(run.path).open(1) as sf:
        np.testing.assert_array_equal(sf["/routing/train"], np.asarray(rec.routing_train))


def test_truncate_after_deletes_the_shards_with_their_steps(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in range(3):
        write_sharded(run.trace_dir, make_record(step), [3])
    run.truncate_after(0)
    assert run.completed_steps() == [0]
    assert sorted(p.name for p in run.trace_dir.iterdir()) == ["step_000000.h5", "step_000000.shards"]


def test_sharded_step_is_plain_hdf5(tmp_path):
    """Outside axrl: h5py (any HDF5 >= 1.10 reader) resolves the virtual datasets itself."""
    rec = make_record(0)
    path = write_sharded(tmp_path, rec, [6])
    with h5py.File(path) as f:
        assert f["routing/train"].is_virtual
        np.testing.assert_array_equal(f["routing/train"][()], np.asarray(rec.routing_train))


class InProcessGroup:
    """RayTrainGroup's part in sharding, its ranks' `KeptRows` in this process: the learner's side
    (`RankShards`) and the ranks' (`KeptRows`) run as under Ray, without a cluster."""

    def __init__(self, ranks: int) -> None:
        from axrl.ray_executor.trace_shards import KeptRows

        self.kept = [KeptRows(r) for r in range(ranks)]
        self.keep_trace_rows, self.last_kept, self._count = False, None, 0

    def forward(self, rec, cuts: list[int]) -> None:
        """The step's policy forward: each rank holds its samples' rows (int64 tensors, as the
        trainer returns them) and hands back the result without the trainer's routing."""
        import torch

        from axrl.train.protocol import ForwardResult

        assert self.keep_trace_rows
        self._count += 1
        off = np.asarray(rec.sample_offsets)
        bounds, starts = [0, *cuts, len(off) - 1], []
        for kept, lo, hi in zip(self.kept, bounds, bounds[1:]):
            a, b = int(off[lo]), int(off[hi])
            # a rank's share of the packed batch: what KeptRows reads of it (make_record's empty
            # sample is no PackedBatch)
            shard = SimpleNamespace(offsets=torch.from_numpy(off[lo:hi + 1] - a),
                                    routed_experts=torch.from_numpy(np.asarray(rec.routing_rollout, np.int64)[a:b]))
            train = torch.from_numpy(np.asarray(rec.routing_train, np.int64)[a:b])
            back = kept.keep(self._count, shard, ForwardResult(torch.zeros(b - a), torch.zeros(b - a), train))
            assert back.routed_experts is None
            starts.append(a)
        self.last_kept = (self._count, starts)

    def write_trace_shards(self, key, trace_dir, step, starts, num_experts, encoding, hold=()):
        return [k.write(key, trace_dir, step, s, num_experts, encoding, hold) for k, s in zip(self.kept, starts)]


def test_learner_and_ranks_write_the_step_a_local_run_writes(tmp_path):
    """RankShards + KeptRows: a step read back as write_step writes it; a step written without
    routing (trace.level standard, between routing_every) gets no shard, and the ranks drop its rows."""
    import dataclasses

    from axrl.ray_executor.trace_shards import RankShards
    from axrl.runtime.recording.tiers import TierSettings, reduce_record

    group = InProcessGroup(3)
    run = RunDir(tmp_path / "run")
    tiers = TierSettings("standard", routing_every=2)
    shards = RankShards(group, run.trace_dir, "packed", tiers)
    recs = [make_record(s, n_groups=3, group_size=2) for s in range(2)]
    for step, rec in enumerate(recs):
        group.forward(rec, [2, 4])
        shards.claim(step)
        # what the learner queues: its record without the routing the ranks hold
        shards.write(reduce_record(RankShards.strip(rec), tiers))
    plain = RunDir(tmp_path / "plain").write_step(reduce_record(recs[0], tiers), routing_encoding="packed")
    with StepFile(run.step_path(0)) as sf, StepFile(plain) as pf:
        assert len(sf.shards) == 3
        assert_records_equal(sf.to_record(), pf.to_record())
    with StepFile(run.step_path(1)) as sf:
        assert not sf.shards and "/routing/train" not in sf and sf.num_tokens == recs[1].num_tokens
    assert not shard_dir(run.trace_dir, 1).exists()
    assert all(not k._rows for k in group.kept)
    assert dataclasses.replace(recs[0]).routing_rollout is not None   # strip copied, never cleared the caller's


def test_spike_ring_with_sharding_leaves_the_k_steps_before_the_spike_full(tmp_path):
    """trace.keep_full with trace.sharded: the ranks hold the ring's rows, a spike at step 4
    (keep_full=2) has them write steps 2 and 3 in full through the learner's background writer,
    over their reduced files; those and the spike step read as the unsharded full step; the other
    steps stay reduced and the ranks end holding only the ring's step."""
    import dataclasses

    from axrl.ray_executor.trace_shards import RankShards
    from axrl.runtime.recording.step_writer import StepWriter
    from axrl.runtime.recording.tiers import TieredRecords, TierSettings

    group = InProcessGroup(3)
    run = RunDir(tmp_path / "run")
    settings = TierSettings("standard", routing_every=3, keep_full=2)
    shards = RankShards(group, run.trace_dir, "packed", settings)
    tiers = TieredRecords(settings)
    writer = StepWriter(shards.write, max_pending=2)
    recs = [make_record(s, n_groups=3, group_size=2) for s in range(6)]
    for rec in recs:
        group.forward(rec, [2, 4])
        shards.claim(rec.step)
        # the learner's record: without the routing the ranks hold
        for out in tiers.for_step(RankShards.strip(rec), spiked=rec.step == 4):
            writer.submit(out)
    writer.close()
    for rec in recs:
        plain = RunDir(tmp_path / "plain").write_step(rec, routing_encoding="packed", overwrite=True)
        with StepFile(run.step_path(rec.step)) as sf, StepFile(plain) as pf:
            if rec.step in (2, 3, 4):
                assert sf.attrs["trace_level"] == "full" and len(sf.shards) == 3
                assert sf.attrs.get("trace_promoted_by") == (4 if rec.step < 4 else None)
                got = dataclasses.replace(sf.to_record(), attrs={})
                assert_records_equal(got, dataclasses.replace(pf.to_record(), attrs={}))
            else:
                assert sf.attrs["trace_level"] == "standard" and "trace_promoted_by" not in sf.attrs
                assert ("/routing/train" in sf) == (rec.step % 3 == 0) == bool(sf.shards)
                np.testing.assert_array_equal(sf["/tokens/old_logprob"], pf["/tokens/old_logprob"])
    assert TraceReader(run.path).problems == []
    # step 5 is the ring's only step now (the spike emptied it): its rows alone are still held
    assert [sorted(k._rows) for k in group.kept] == [[6]] * 3


@pytest.mark.parametrize("extra, sharded", [
    ([], False),                                                            # local: one process
    (["runtime.executor=ray"], False),                                      # one train rank
    (["runtime.executor=ray", "runtime.ray.train_ranks=2"], True),
    (["runtime.executor=ray", "runtime.ray.train_ranks=2", "trace.routing_encoding=packed"], True),
    (["runtime.executor=ray", "runtime.ray.train_ranks=2", "trace.sharded=false"], False),
    (["runtime.executor=ray", "trace.sharded=true"], True),
    (["runtime.executor=ray", "runtime.ray.train_ranks=2", "trace.level=standard", "trace.keep_full=2",
      "trace.spike_ratio=2"], True),                                      # the ranks hold the ring's rows
])
def test_trace_sharded_auto(extra, sharded):
    from axrl.assembly.settings import trace_sharded
    from axrl.config import load_config

    assert trace_sharded(load_config(ROOT / "examples" / "quickstart.yaml", extra)) is sharded


@pytest.mark.parametrize("extra, names", [
    (["trace.sharded=true"], "runtime.executor: ray"),
    (["runtime.executor=ray", "trace.sharded=true", "trace.routing=false"], "sharded: true needs enabled and routing"),
])
def test_trace_sharded_true_where_it_cannot_be_is_refused(extra, names):
    from axrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=names):
        load_config(ROOT / "examples" / "quickstart.yaml", extra)
