"""trace.sharded on a real local Ray cluster: the train ranks write the routing rows they hold into
the step's shard files, the learner the index; the step reads, analyses and replays as a local
run's does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ray  # noqa: E402  (the test extra installs it: a broken import fails)

from axrl.assembly.build import train  # noqa: E402
from axrl.trace import StepFile, TraceReader  # noqa: E402
from axrl.trace import schema as S  # noqa: E402
from axrl_debug.cli import app as debug_app  # noqa: E402
from tests.test_ray import SMALL  # noqa: E402
from tests.test_ray import cfg as ray_cfg  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def cfg(*extra: str):
    """test_ray.py's tiny MoE run, two steps (each with a checkpoint, for replay)."""
    return ray_cfg("steps=2", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A local run, the same run on Ray with one train rank writing sharded steps, and one with two
    data-parallel ranks (trace.sharded: auto turns it on) packing their routing."""
    base = tmp_path_factory.mktemp("shards")
    out = {"local": train(cfg(), base / "local")}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="warning", log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        out["sharded"] = train(cfg("runtime.executor=ray", "trace.sharded=true"), base / "sharded")
        out["dp2"] = train(cfg("runtime.executor=ray", "runtime.ray.train_ranks=2", "trace.routing_encoding=packed",
                               *SMALL), base / "dp2")
        out["dp2_r3"] = train(cfg("runtime.executor=ray", "runtime.ray.train_ranks=2", "r3=true", *SMALL),
                              base / "dp2_r3")
    finally:
        ray.shutdown()
    return out


def step_arrays(run: Path, step: int) -> dict:
    with TraceReader(run).open(step) as sf:
        data = sf.read_all()
    # what differs between any two runs (when, how long; the learner's RNG state is per process)
    # and the index's list of its shards
    data["attrs"] = {k: v for k, v in data["attrs"].items() if not k.startswith(S.WALL_TIME_PREFIX)
                     and k not in (S.ATTR_CREATED_UNIX, S.ATTR_RNG_DIGEST, S.ATTR_SHARD_FILES)}
    return data


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype == object:
        return a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_sharded_ray_steps_read_as_the_local_ones_bit_for_bit(runs):
    for step in (0, 1):
        shards = runs["sharded"] / "trace" / f"step_{step:06d}.shards"
        assert sorted(p.name for p in shards.iterdir()) == ["train_rank0.h5"]
        with StepFile(runs["sharded"] / "trace" / S.step_file_name(step)) as sf:
            assert sf.shards and sf["/routing/train"].shape[0] == sf.num_tokens
        a, b = step_arrays(runs["local"], step), step_arrays(runs["sharded"], step)
        assert a.keys() == b.keys()
        assert a["attrs"] == b["attrs"] and a["group_attrs"] == b["group_attrs"]
        assert [k for k in a if k not in ("attrs", "group_attrs") and not same(a[k], b[k])] == []
    assert TraceReader(runs["sharded"]).problems == []


def debug_json(*args) -> dict:
    out = CliRunner().invoke(debug_app, [str(a) for a in args])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def without_paths(doc, run: Path):
    """A command's JSON with the run's own path taken out (the only thing two runs' reports differ in)."""
    return json.loads(json.dumps(doc).replace(str(run), "RUN"))


@pytest.mark.parametrize("command", [["mismatch", "--json"], ["summary", "--json"]])
def test_debug_commands_report_sharded_and_unsharded_alike(runs, command):
    local, sharded = (without_paths(debug_json(command[0], runs[k], *command[1:]), runs[k])
                      for k in ("local", "sharded"))
    assert local == sharded


def test_replay_of_a_sharded_step_is_bitwise(runs):
    out = CliRunner().invoke(debug_app, ["replay", str(runs["sharded"]), "--step", "1", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "bitwise-equal"


def test_each_data_parallel_rank_writes_its_own_rows(runs):
    run = runs["dp2"]
    plane = json.loads((run / "data_plane.json").read_text())
    for step in (0, 1):
        shards = run / "trace" / f"step_{step:06d}.shards"
        assert sorted(p.name for p in shards.iterdir()) == ["train_rank0.h5", "train_rank1.h5"]
        with TraceReader(run).open(step) as sf:
            off, t = sf["/samples/offsets"], sf.num_tokens
            assert sf.group_attrs("/routing")["encoding"] == "packed-v1" and sf._f["/routing/train_rows"].is_virtual
            starts = sorted(int(vs.vspace.get_select_bounds()[0][0])
                            for vs in sf._f["/routing/rollout_valid"].virtual_sources())
            # two shares, split at a sample boundary, covering the step
            assert len(starts) == 2 and starts[0] == 0 and 0 < starts[1] < t and starts[1] in off
            train_rows, rollout_rows = sf["/routing/train"], sf["/routing/rollout"]
        local = step_arrays(runs["local"], step)
        # the engine's routing is the local run's (same samples); the trainer's is each rank's own forward
        np.testing.assert_array_equal(rollout_rows, local["/routing/rollout"])
        assert train_rows.shape == local["/routing/train"].shape and (train_rows == local["/routing/train"]).mean() > 0.9
    # the trainer's routing never went back to the learner: the forward results carried logprobs
    # and entropy only (float32 + float32 a token), not its [T, L, k] int64 routing
    tokens = sum(len(step_arrays(run, s)["/tokens/ids"]) for s in (0, 1))
    assert plane["actor_calls"]["forward_results"] == 8 * tokens, (plane["actor_calls"], tokens)


@pytest.mark.parametrize("run", ["sharded", "dp2"])
def test_the_engine_routing_goes_to_the_ranks_past_the_learner(runs, run):
    """No R3: the rollout actor puts each sample's engine routing in the object store and the rank
    that writes it fetches it; the learner's process never holds any of it, and every /routing
    dataset of the index (raw or packed) is virtual, mapped onto the ranks' shard files only."""
    plane = json.loads((runs[run] / "data_plane.json").read_text())
    assert plane["actor_calls"]["engine_routing_at_learner"] == 0
    # what the rollout actor put is every trained token's engine routing (the micro MoE's
    # [T, L=2, k=2] int32 ids as the engine returns them)
    with TraceReader(runs[run]).open(0) as sf:
        layers, k = sf["/routing/rollout"].shape[1:]
    tokens = sum(len(step_arrays(runs[run], s)["/tokens/ids"]) for s in (0, 1))
    assert plane["by_ref"]["engine_routing"] == tokens * layers * k * 4
    for step in (0, 1):
        with TraceReader(runs[run]).open(step) as sf:
            routing = sf._f["routing"]
            assert len(routing) >= 3 and all(routing[name].is_virtual for name in routing)
            assert {Path(vs.file_name).name for name in routing for vs in routing[name].virtual_sources()} <= {
                "train_rank0.h5", "train_rank1.h5"}


def test_under_r3_the_engine_routing_comes_with_the_batch_and_the_ranks_still_write_it(runs):
    """R3: the ranks replay the engine's routing from their batch, which the learner builds, so it
    reaches the learner; the ranks still write it (and their own, equal where replayed)."""
    run = runs["dp2_r3"]
    plane = json.loads((run / "data_plane.json").read_text())
    assert plane["actor_calls"]["engine_routing_at_learner"] > 0 and "engine_routing" not in plane["by_ref"]
    with TraceReader(run).open(0) as sf:
        assert sorted(Path(p).name for p in sf.shards) == ["train_rank0.h5", "train_rank1.h5"]
        rollout, train_rows, valid = sf["/routing/rollout"], sf["/routing/train"], sf["/routing/rollout_valid"]
    np.testing.assert_array_equal(rollout, step_arrays(runs["local"], 0)["/routing/rollout"])  # same samples
    np.testing.assert_array_equal(train_rows[valid == 1], rollout[valid == 1])


@pytest.mark.parametrize("extra, by_reference", [
    (["runtime.ray.train_ranks=2"], True),
    (["runtime.ray.train_ranks=2", "r3=true"], False),               # the ranks replay it from their batch
    (["runtime.ray.train_ranks=2", "algo.dynamic_sampling.enabled=true"], False),   # /pool keeps dropped samples'
    (["runtime.ray.train_ranks=2", "trace.sharded=false"], False),
])
def test_engine_routing_by_reference_only_where_training_does_not_need_it(extra, by_reference):
    from axrl.assembly.settings import learner_settings
    from axrl.ray_executor.trace_shards import engine_routing_by_reference

    assert engine_routing_by_reference(learner_settings(ray_cfg("runtime.executor=ray", *extra))) is by_reference


# The spike ring (trace.keep_full) with sharding on two ranks: trace.level standard writes routing
# on every third step; a spike trigger with a ratio just above 1 fires on the first step whose
# grad norm exceeds the previous ones' median (the assertions follow whichever steps it flags).
RING = ["runtime.executor=ray", "runtime.ray.train_ranks=2", *SMALL, "trace.level=standard", "trace.routing_every=3",
        "trace.keep_full=1", "trace.spike_ratio=1.0001", "trace.spike_min_history=1"]


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory) -> dict[str, Path]:
    """The same four-step two-rank run, sharded with a keep_full ring and unsharded at level full."""
    base = tmp_path_factory.mktemp("ring")
    out = {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="warning", log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        out["ring"] = train(ray_cfg("steps=4", *RING), base / "ring")
        out["whole"] = train(ray_cfg("steps=4", *RING[:3], "trace.sharded=false"), base / "whole")
    finally:
        ray.shutdown()
    return out


def test_spike_ring_with_sharding_leaves_the_steps_before_the_spike_full(ring_runs):
    run = ring_runs["ring"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    spikes = [m["step"] for m in metrics if m.get("spike")]
    assert spikes, "the trigger never fired: the test needs a spike (see RING)"
    full = {s for n in spikes for s in (n - 1, n)}
    reader = TraceReader(run)
    assert reader.steps == [0, 1, 2, 3] and reader.problems == []
    for step in reader.steps:
        shards = run / "trace" / f"step_{step:06d}.shards"
        with reader.open(step) as sf:
            level, promoted = sf.attrs["trace_level"], sf.attrs.get("trace_promoted_by")
            routed = "/routing/rollout" in sf
            names = sorted(Path(p).name for p in sf.shards)
        if step in full:
            assert level == "full" and routed and promoted == (None if step in spikes else step + 1), step
            # the ranks wrote the rows they held, the learner the full index over them
            assert names == ["train_rank0.h5", "train_rank1.h5"]
            # and the step reads as the unsharded run's, array for array (both routings included)
            data, whole = step_arrays(run, step), step_arrays(ring_runs["whole"], step)
            assert data.keys() == whole.keys()
            assert [k for k in data if k not in ("attrs", "group_attrs") and not same(data[k], whole[k])] == []
        else:
            assert level == "standard" and promoted is None and routed == (step % 3 == 0) == bool(names), step
            assert shards.is_dir() == routed
    # mismatch reads the run's reduced and promoted steps alike (replay: the one-rank run above; a
    # two-rank step replays in one process, which splits its micro-batches differently)
    assert debug_json("mismatch", run, "--json")["steps"] == [0, 1, 2, 3]
