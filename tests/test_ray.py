"""runtime.executor: ray on a real local Ray cluster (2 CPUs, 127.0.0.1), started and stopped here.

The ray runs drive the same loop as local ones; the engine and the train ranks are actors.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import ray  # noqa: E402  (the test extra installs it: a broken import fails)

from trace_util import trace_datasets  # noqa: E402
from axrl.config import ConfigError, load_config  # noqa: E402
from axrl.runtime.recording.events import read_events  # noqa: E402
from axrl.assembly.build import train  # noqa: E402
from axrl.ray_executor.wire import wire_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)
# A tiny run whose every step really changes the weights (the entropy bonus gives a gradient even
# when an untrained policy earns no reward), with a checkpoint after every step.
TINY = ["steps=3", "model.preset=micro-moe", "warmup.steps=0", "data.task=echo", "data.task_args={turns: 1}",
        "data.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        "rollout.max_context_len=128", "rollout.max_batch_size=8", "eval.every=0", "checkpoint.every=1",
        "runtime.threads=1", "algo.entropy_coef=0.05", "train.lr=1e-2", "algo.loss_agg=token-mean"]
# Fractions of a CPU: two train ranks and the engine fit a 2-CPU cluster.
SMALL = ["runtime.ray.placement.train_cpus=0.5", "runtime.ray.placement.engine_cpus=0.5"]


def cfg(*extra: str):
    return load_config(ROOT / "examples" / "quickstart.yaml", [*TINY, *extra])


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="warning",
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def differing(a: dict, b: dict) -> list:
    def same(x, y) -> bool:
        x, y = np.asarray(x), np.asarray(y)
        return x.tolist() == y.tolist() if x.dtype == object else x.shape == y.shape and x.tobytes() == y.tobytes()
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not same(a[k], b[k])]


def sample_ids(run_dir: Path) -> list[list[int]]:
    out = []
    for f in sorted((run_dir / "trace").glob("step_*.h5")):
        with h5py.File(f) as h:
            out.append(h["samples/sample_id"][()].tolist())
    return out


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "run"
    train(cfg(), out)
    return out


def test_ray_sync_run_writes_the_local_trace_bit_for_bit(cluster, local_run, tmp_path):
    out = train(cfg("runtime.executor=ray"), tmp_path / "ray")
    a, b = trace_datasets(local_run), trace_datasets(out)
    assert len(a) > 50
    assert not differing(a, b)
    # Training really moved the weights: the fingerprints of successive steps differ.
    with h5py.File(out / "trace" / "step_000002.h5") as h:
        assert h["train/weights_fingerprint_before"][()] != h["train/weights_fingerprint_after"][()]
    events = read_events(out)
    assert [e["component"] for e in events if e["event"] == "actors_started"] == [
        "train group", "rollout worker", "engine", "learner"]
    # What crossed the driver, measured (every get / put / actor call / actor start of this
    # process at Ray's serialised size): the actors' settings at start-up, heartbeats, and per step
    # the calls and their answers. The trajectories, batches, per-token outputs and weights moved
    # between the actors.
    plane = json.loads((out / "data_plane.json").read_text())
    driver, between = plane["driver"], plane["by_ref"]
    assert {"start RolloutActor", "start LearnerActor", "start TrainRankActor", "call step", "result step",
            "call take", "result take", "result activity"} <= set(driver)
    assert {"trajectories", "batch", "weights"} == set(between)
    assert {"forward_results", "engine_results", "train_metrics"} <= set(plane["actor_calls"])
    # Per step, the driver must carry the step's metrics row (learner → driver: what metrics.jsonl
    # gets), the batch reference with the rollout snapshot, the weights handle, and heartbeats:
    # a few times the metrics row. The batch itself (serialised) is far larger.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics_row = max(wire_bytes(r) for r in rows)
    per_step = sum(n for k, n in driver.items() if not k.startswith("start ")) / len(rows)
    assert per_step < 8 * metrics_row + 4096, (per_step, metrics_row, driver)
    assert per_step < 0.5 * between["batch"] / len(rows) and sum(driver.values()) < 0.05 * sum(between.values())


def test_ppo_with_a_critic_on_ray_train_ranks_writes_the_local_trace(cluster, tmp_path):
    """The critic lives on the train ranks: one rank writes the in-process run's trace bit for bit
    (values, returns, advantages, the critic's fingerprints); two ranks (each trains the critic on
    the whole batch) agree with it to float rounding, as the policy's data-parallel ranks do."""
    # The overlong penalty rewards the untrained policy (its task reward is 0), so the critic learns.
    ppo = ["algo.advantage=gae", "algo.lam=0.9", "critic={lr: 1.0e-3, updates_per_step: 2}",
           "algo.overlong_penalty={max_len: 8, cache_len: 6}"]
    local = train(cfg(*ppo), tmp_path / "local")
    out = train(cfg(*ppo, "runtime.executor=ray"), tmp_path / "ray")
    a, b = trace_datasets(local), trace_datasets(out)
    assert ("step_000001.h5", "tokens/value") in a
    assert not differing(a, b)
    for step in range(3):
        with h5py.File(local / "trace" / f"step_{step:06d}.h5") as x, h5py.File(out / "trace" / f"step_{step:06d}.h5") as y:
            assert x.attrs["critic_fingerprint_after"] == y.attrs["critic_fingerprint_after"]
            assert x.attrs["critic_fingerprint_before"] != x.attrs["critic_fingerprint_after"]
    assert (out / "checkpoints" / "step_000002" / "critic" / "model.safetensors").is_file()
    dp2 = trace_datasets(train(cfg(*ppo, "runtime.executor=ray", "runtime.ray.train_ranks=2", *SMALL), tmp_path / "dp2"))
    for key in a:
        if key[1] in ("tokens/value", "tokens/return"):
            np.testing.assert_allclose(a[key], dp2[key], atol=2e-3)


def test_driver_wire_counts_a_payload_through_the_driver_once(cluster):
    """The accounting catches what really crosses the driver: an array sent as a call's argument,
    a result twice its size (read twice, counted once), an array put by the driver, an actor's
    start-up arguments — each at its serialised size."""
    from axrl.ray_executor.handles import DataPlane
    from axrl.ray_executor.wire import DriverWire

    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self, settings: dict) -> None:
            self.settings = settings

        def twice(self, a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, a])

    plane = DataPlane()
    wire = DriverWire(plane).open()
    try:
        a = np.ones(250_000, dtype=np.float32)   # 1 MB
        echo = Echo.remote({"key": "x" * 5000})
        ref = echo.twice.remote(a)
        assert ray.get(ref).nbytes == 2 * a.nbytes
        ray.get([ref])                           # the same object again: not counted again
        put = ray.put(a)
        ray.get(put)                             # the driver's own put: counted once, as the put
    finally:
        wire.close()
    got = plane.snapshot()["driver"]
    assert set(got) == {"start Echo", "call twice", "result twice", "put"}
    assert a.nbytes < got["call twice"] < a.nbytes + 1024
    assert 2 * a.nbytes < got["result twice"] < 2 * a.nbytes + 1024
    assert a.nbytes < got["put"] < a.nbytes + 1024
    assert 5000 < got["start Echo"] < 6000
    assert ray.get.__name__ == "get"            # closed: Ray's own functions are back


def expected_ids(steps: int, prompts: int = 2, group: int = 2) -> list[list[int]]:
    """Sync runs train groups w·P … w·P + P − 1 at step w: every sample once, none lost."""
    return [list(range(w * prompts * group, (w + 1) * prompts * group)) for w in range(steps)]


def test_engine_memory_released_while_the_trainer_trains_changes_no_bit(cluster, local_run, tmp_path):
    """rollout.release_memory: the engine actor frees its KV cache each time it waits for the
    trainer's weights (what a GPU shared with the trainer needs) and allocates it again before the
    next batch: the trace is the local run's, bit for bit."""
    out = train(cfg("runtime.executor=ray", "rollout.release_memory=true", "runtime.ray.heartbeat_s=0.1"),
                tmp_path / "release")
    assert not differing(trace_datasets(local_run), trace_datasets(out))
    engine = next(a for a in json.loads((out / "status.json").read_text())["actors"] if a["component"] == "engine")
    assert engine["totals"]["memory_releases"] >= 2   # after batch 0 and batch 1 (3 steps)


def test_two_data_parallel_ranks_train_like_one_process(cluster, local_run, tmp_path):
    out = train(cfg("runtime.executor=ray", "runtime.ray.train_ranks=2", *SMALL), tmp_path / "dp2")
    a, b = trace_datasets(local_run), trace_datasets(out)
    assert a.keys() == b.keys()
    # The same samples; logprobs and losses agree to float rounding (the ranks sum the gradient in
    # another order than one process accumulating its micro-batches).
    for key in a:
        if key[1] in ("samples/sample_id", "tokens/input_ids", "tokens/loss_mask"):
            assert np.array_equal(a[key], b[key]), key
        if key[1] in ("tokens/old_logprob", "tokens/rollout_logprob"):
            np.testing.assert_allclose(a[key], b[key], atol=2e-4, equal_nan=True)
    events = read_events(out)
    started = next(e for e in events if e["event"] == "actors_started" and e["component"] == "train group")
    assert started["ranks"] == 2 and len(set(started["pids"])) == 2


@pytest.mark.slow
def test_megatron_ranks_as_actors_write_the_local_megatron_trace_bit_for_bit(cluster, tmp_path):
    """train.backend: megatron with TP 2 × EP 2 under ray: the backend's two ranks are Ray actors
    in the placement's train slots forming their own gloo group (instead of the worker processes
    the backend launches itself under local): the same trace, bit for bit."""
    import megatron.core  # noqa: F401  (the test extra installs it)
    meg = ["train.backend=megatron", "train.megatron.tensor_parallel=2", "train.megatron.expert_parallel=2"]
    local = train(cfg(*meg), tmp_path / "local")
    out = train(cfg(*meg, "runtime.executor=ray", *SMALL), tmp_path / "ray")
    a, b = trace_datasets(local), trace_datasets(out)
    assert len(a) > 50 and not differing(a, b)
    status = json.loads((out / "status.json").read_text())
    assert sorted(r["component"] for r in status["actors"] if r["component"].startswith("megatron")) == [
        "megatron rank 0", "megatron rank 1"]
    # DP 1: both ranks are TP ranks of one DP rank, so they fetch the same share — one object
    # in the store per call, not one per rank: what each rank counted fetching (the actors' own
    # account) is all of what the backend put in the store (counted once per object by the sender).
    plane = json.loads((out / "data_plane.json").read_text())
    fetched = {k: v for k, v in plane["rank_fetched"].items() if k.startswith("megatron")}
    assert sorted(fetched) == ["megatron rank 0", "megatron rank 1"]
    assert fetched["megatron rank 0"] == fetched["megatron rank 1"] == plane["rank_share"]["megatron rank 0"] > 0
    # by reference: the one object per call, at its serialised size (its tensors and the pickled
    # structure around them)
    assert plane["by_ref"]["megatron_shares"] > fetched["megatron rank 0"]


@pytest.mark.slow
def test_megatron_rank_actors_each_fetch_only_their_data_parallel_share(cluster):
    """TP 1 × EP 2 derives DP 2: the backend cuts every micro-batch into the two DP ranks' shares,
    each rank actor is sent only the reference to its own and fetches about half the batch, and
    the actors compute what the backend's own worker processes compute, bit for bit."""
    import megatron.core  # noqa: F401  (the test extra installs it)
    import torch

    from axrl.model import build_model, preset_config
    from axrl.ray_executor.handles import DataPlane, payload_bytes
    from axrl.ray_executor.megatron_ranks import RayRankGroup
    from axrl.train.megatron import MegatronBackend, MegatronBackendConfig
    from axrl.train.megatron.shares import split_for_ranks
    from tests.backend_util import make_batch
    from tests.test_train_backend import pg_loss

    plane, groups = DataPlane(in_driver=False), []

    def rank_actors(*args):
        groups.append(RayRankGroup(*args, slots=[{"num_cpus": 0.5}] * 2, call_timeout_s=300, plane=plane))
        return groups[-1]

    conf = dict(lr=1e-2, num_threads=1, micro_batch_tokens=24, expert_parallel=2)
    local = MegatronBackend(build_model(preset_config("micro-moe"), seed=9), MegatronBackendConfig(**conf))
    on_ray = MegatronBackend(build_model(preset_config("micro-moe"), seed=9), MegatronBackendConfig(**conf),
                             group=rank_actors)
    try:
        assert on_ray.config.data_parallel_size == 2
        batch = make_batch(lengths=[5, 9, 3, 12, 8])
        a, b = local.forward(batch), on_ray.forward(batch)
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.routed_experts, b.routed_experts)
        m1, m2 = local.forward_backward(batch, pg_loss), on_ray.forward_backward(batch, pg_loss)
        s1, s2 = local.optimizer_step(), on_ray.optimizer_step()
        assert m1.loss == m2.loss and s1.grad_norm == s2.grad_norm > 0
        assert local.fingerprint() == on_ray.fingerprint()
        # What each rank actor says it fetched, against DP rank r's work as the backend's split
        # cuts this batch, twice (forward, forward_backward): its own share, not the other rank's
        # (the two differ in size) nor the whole batch.
        works = split_for_ranks(batch, 2, on_ray._knobs())
        expected = {f"megatron rank {r}": 2 * payload_bytes(works[r]) for r in range(2)}
        assert len(set(expected.values())) == 2
        assert groups[0].fetched_bytes() == expected
        whole = 2 * payload_bytes(batch)
        assert all(0.3 * whole < n < 0.7 * whole for n in expected.values()), (expected, whole)
        snap = plane.snapshot()
        assert snap["rank_share"] == expected
        # one object per DP rank and call (4), each at its serialised size: its tensors plus the
        # pickled structure around them (a few KB per object at this tiny size)
        assert sum(expected.values()) < snap["by_ref"]["megatron_shares"] < sum(expected.values()) + 4 * 8192
    finally:
        local.close()
        on_ray.close()


def test_sglang_servers_managed_by_the_rollout_actor_write_the_local_trace(cluster, tmp_path):
    """rollout.engine: sglang under ray: the rollout actor launches the server (`axrl serve`,
    SGLang's HTTP API) and syncs weights to it through the process group itself, fetching them
    from train rank 0's object store: the same trace as the local run, bit for bit."""
    sglang = ["rollout.engine=sglang", "rollout.sglang.server=axrl", "rollout.sglang.weight_sync=distributed"]
    local = train(cfg(*sglang), tmp_path / "local")
    out = train(cfg(*sglang, "runtime.executor=ray", *SMALL), tmp_path / "ray")
    assert not differing(trace_datasets(local), trace_datasets(out))
    started = [e for e in read_events(out) if e["event"] == "actors_started" and e["component"] == "engine"]
    assert len(started) == 1 and started[0]["servers"]


def test_async_ray_run_honours_the_staleness_bound(cluster, tmp_path):
    """No trained token is more than max_staleness = 1 weight versions older than the weights it is
    trained on, and the bound is reached: the engine actor generated ahead of the trainer (a run
    that behaved synchronously, every token of lag 0, would test nothing) — except at the
    checkpoint before step 2, where the pipeline drains (checkpoint.quiescent, the default)."""
    out = train(cfg("runtime.executor=ray", "runtime.mode=async", "rollout.max_staleness=1", "steps=4",
                    "checkpoint.every=2"), tmp_path / "async")
    lags = []
    for f in sorted((out / "trace").glob("step_*.h5")):
        with h5py.File(f) as h:
            versions = h["tokens/policy_version"][()][h["tokens/loss_mask"][()] > 0]
            lag = int(h.attrs["policy_version"]) - versions
            assert versions.size and lag.min() >= 0 and lag.max() <= 1, (f.name, lag.min(), lag.max())
            lags.append(int(lag.max()))
    assert lags == [0, 1, 0, 1], f"per-step max lag {lags}: stale tokens at steps 1 and 3, none at 0 and 2"


def test_free_running_ray_run_with_warm_up_and_eval(cluster, tmp_path):
    """runtime.deterministic: false drives the engine actor free-running (its own scheduler thread,
    finished requests collected by the proxy's poller); warm-up and eval go through the protocols too."""
    out = train(cfg("runtime.executor=ray", "runtime.deterministic=false", "steps=2", "warmup.steps=2",
                    "eval.every=2", "eval.prompts=2"), tmp_path / "free")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert "eval_reward" in metrics[0] and "eval_reward_final" in metrics[1]
    assert sample_ids(out) == expected_ids(2)
    # The supervised warm-up runs in the driver: its batches cross the driver (put, measured).
    driver = json.loads((out / "data_plane.json").read_text())["driver"]
    assert driver["put"] > max(n for k, n in driver.items() if k != "put")


def test_bad_address_fails_before_work_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="runtime.ray.address"):
        train(cfg("runtime.executor=ray", "runtime.ray.address=127.0.0.1:1"), tmp_path / "bad")
    with pytest.raises(ConfigError, match="runtime.ray.address"):
        train(cfg("runtime.executor=ray", "runtime.ray.address=not-an-address"), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_impossible_placement_fails_before_work_naming_the_key(cluster, tmp_path):
    with pytest.raises(ConfigError, match="runtime.ray.placement.*needs 9 CPUs; the cluster has 2"):
        train(cfg("runtime.executor=ray", "runtime.ray.train_ranks=8"), tmp_path / "big")
    # Fits the cluster's total but not one node: STRICT_SPREAD needs a node per bundle.
    with pytest.raises(ConfigError, match="cannot be placed within runtime.ray.placement.timeout_s"):
        train(cfg("runtime.executor=ray", "runtime.ray.placement.strategy=STRICT_SPREAD", *SMALL,
                  "runtime.ray.placement.timeout_s=3"), tmp_path / "spread")
    assert not (tmp_path / "big").exists() and not (tmp_path / "spread").exists()
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


GPU_PLACEMENT = """
import json, sys
import ray
from axrl.config import ConfigError, load_config
from axrl.ray_executor.placement import place
# A CPU machine: Ray is told the node has one GPU; it schedules and assigns it like a real one.
ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
         logging_level="warning", log_to_driver=False)
gpus = ["runtime.executor=ray", "runtime.device=cuda", "runtime.ray.placement.train_cpus=0.5",
        "runtime.ray.placement.engine_cpus=0.5"]
cfg = load_config(sys.argv[1], gpus + ["runtime.ray.placement.train_gpus=0.5", "runtime.ray.placement.engine_gpus=0.5"])
placement = place(ray, cfg.runtime.ray.placement, 1)
probe = ray.remote(lambda: ray.get_gpu_ids())
slots = {"train": placement.train[0], "engine": placement.engine}
out = {name: ray.get(probe.options(**slot.options()).remote()) for name, slot in slots.items()}
placement.release(ray)
try:
    place(ray, load_config(sys.argv[1], gpus + ["runtime.ray.placement.train_gpus=1",
                                                "runtime.ray.placement.engine_gpus=1"]).runtime.ray.placement, 1)
except ConfigError as e:
    out["refused"] = str(e)
# The training service runs no engine: the same GPUs that refused train + engine hold the train rank alone.
alone = place(ray, load_config(sys.argv[1], gpus + ["runtime.ray.placement.train_gpus=1",
                                                    "runtime.ray.placement.engine_gpus=1"]).runtime.ray.placement,
              1, engine=False)
out["alone"] = {"engine": alone.engine is None, "gpu": ray.get(probe.options(**alone.train[0].options()).remote()),
                "bundles": [len(ray.util.placement_group_table(g)["bundles"]) for g in alone.groups]}
alone.release(ray)
print(json.dumps(out))
"""


def test_gpu_placement_colocates_engine_and_trainer_on_one_gpu(tmp_path):
    """train_gpus / engine_gpus of 0.5 in one colocated placement group put the train rank and the
    engine on the same GPU (what rollout.release_memory is for); more GPUs than the cluster has are
    refused before any work, naming the keys; a driver without an engine (the training service)
    reserves the train ranks alone. Run on a Ray node that declares one GPU (this machine
    has none, so nothing computes on it: the placement is what is tested)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", GPU_PLACEMENT, str(ROOT / "examples" / "quickstart.yaml")],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["train"] == out["engine"] and len(out["train"]) == 1
    assert "needs 2 GPUs; the cluster has 1" in out["refused"] and "train_gpus=1" in out["refused"]
    assert out["alone"] == {"engine": True, "gpu": out["train"], "bundles": [1]}


def test_gpu_keys_name_what_is_missing():
    with pytest.raises(Exception, match="runtime.ray.placement.train_gpus"):
        cfg("runtime.executor=ray", "runtime.device=cuda")
    with pytest.raises(Exception, match="set runtime.device: cuda"):
        cfg("runtime.executor=ray", "runtime.ray.placement.train_gpus=1")
    with pytest.raises(Exception, match="rollout.release_memory.*runtime.mode: sync"):
        cfg("rollout.release_memory=true", "runtime.mode=async", "checkpoint.quiescent=false")


def test_without_ray_the_error_names_the_extra(monkeypatch):
    import builtins

    from axrl.ray_executor.cluster import import_ray

    real = builtins.__import__
    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"pip install 'axrl\[ray\]'"):
        import_ray()


def kill_when(run_dir: Path, component: str, after_steps: int, killed: list) -> None:
    """Kill (SIGKILL, by PID) the actor of `component` once `after_steps` steps are recorded and
    the run's health table (RUN/status.json) shows its PID (the engine's with requests in flight)."""
    from axrl.ray_executor.monitor import read_status

    deadline = time.time() + 300
    while time.time() < deadline:
        status = read_status(run_dir) if (run_dir / "status.json").exists() else None
        if status and len(list((run_dir / "trace").glob("step_*.h5"))) >= after_steps:
            rows = [a for a in status["actors"] if str(a.get("component", "")).startswith(component)]
            # The engine with all 8 live episodes (rollout.max_batch_size) in flight: early in a turn, so the kill lands
            # before they finish.
            busy = [a for a in rows if a.get("pid") and (component != "engine" or a.get("in_flight", 0) >= 8)]
            if busy:
                os.kill(busy[0]["pid"], signal.SIGKILL)
                killed.append(busy[0]["pid"])
                return
        time.sleep(0.002)


def run_with_kill(tmp_path: Path, component: str, *extra: str) -> tuple[Path, list]:
    import threading

    out, killed = tmp_path / "run", []
    killer = threading.Thread(target=kill_when, args=(out, component, 1, killed), daemon=True)
    killer.start()
    # Longer turns than TINY's, and a fast heartbeat, so the kill lands on work in flight. Under Ray,
    # `train` resumes a lost train group from its last checkpoint (runtime.ray.train_restarts).
    train(cfg("runtime.executor=ray", "steps=5", "rollout.max_new_tokens=48", "rollout.group_size=4",
              "data.prompts_per_step=4", "runtime.ray.heartbeat_s=0.05", *extra), out, False)
    killer.join(timeout=5)
    return out, killed


def test_killed_engine_actor_is_restarted_and_no_sample_is_lost_or_duplicated(cluster, tmp_path):
    out, killed = run_with_kill(tmp_path, "engine")
    assert killed
    assert sample_ids(out) == expected_ids(5, prompts=4, group=4)
    restarts = [e for e in read_events(out) if e["event"] == "actor_restarted"]
    assert len(restarts) == 1 and restarts[0]["component"] == "engine" and restarts[0]["old_pid"] == killed[0]
    assert restarts[0]["requeued_requests"] > 0   # it died with requests in flight; they were re-run
    # The story is in the run directory: `axrl status` and `axrl-debug summary` show it.
    from typer.testing import CliRunner

    from axrl.cli import app
    from axrl_debug.cli import app as debug_app

    status = CliRunner().invoke(app, ["status", str(out)], env={"COLUMNS": "250"})
    assert status.exit_code == 0 and "train rank 0" in status.output and "actor_restarted" in status.output
    assert f"old_pid={killed[0]}" in status.output
    summary = CliRunner().invoke(debug_app, ["summary", str(out)], env={"COLUMNS": "250"})
    assert summary.exit_code == 0 and "actor_restarted: engine" in summary.output
    summary_json = json.loads(CliRunner().invoke(debug_app, ["summary", str(out), "--json"]).output)
    assert [e["event"] for e in summary_json["events"]] == ["actor_restarted"]


def test_status_table_keeps_actor_names_whole_beside_a_long_error():
    """`axrl status` off a terminal prints 140 columns; an actor's 300-character last error (what
    a dead engine leaves on the rollout worker) wraps in its own column, never the actor's name."""
    from rich.console import Console

    from axrl.console.health_table import health_table

    rows = [{"component": "train rank 0", "state": "idle", "pid": 17341, "heartbeat": 0.0, "calls": 51, "errors": 0},
            {"component": "rollout worker", "state": "busy", "pid": 17371, "heartbeat": 0.0, "calls": 6, "errors": 1,
             "work": "generate: 8 episodes of step 3", "since_s": 1.2,
             "last_error": ("generate: ActorDiedError: " + "The actor died unexpectedly before finishing. " * 6)[:300]}]
    for width in (140, 80):
        console = Console(width=width, record=True)
        console.print(health_table(rows, 0.0, title="actors"))
        text = console.export_text()
        assert "train rank 0" in text and "rollout worker" in text and "17371" in text, text


def test_killed_rollout_actor_is_restarted_and_the_trace_is_the_unfaulted_one(cluster, tmp_path):
    """The rollout actor (agent loop, pool; its engine actor dies with it) is killed mid-run: a new
    one starts at the step being taken, from the snapshot handed over with the last batch, and
    re-runs the groups in flight under their own ids and seeds — in a deterministic run the trace
    is then the unfaulted run's, bit for bit."""
    out, killed = run_with_kill(tmp_path, "rollout worker")
    assert killed
    assert sample_ids(out) == expected_ids(5, prompts=4, group=4)
    restarts = [e for e in read_events(out) if e["event"] == "actor_restarted"]
    assert len(restarts) == 1 and restarts[0]["component"] == "rollout worker"
    assert restarts[0]["old_pid"] == killed[0] and restarts[0]["next_step"] >= 1
    clean = train(cfg("runtime.executor=ray", "steps=5", "rollout.max_new_tokens=48", "rollout.group_size=4",
                      "data.prompts_per_step=4"), tmp_path / "clean")
    assert not differing(trace_datasets(clean), trace_datasets(out))


def test_killed_train_actor_restarts_the_group_from_the_last_checkpoint(cluster, tmp_path):
    out, killed = run_with_kill(tmp_path, "train rank")
    assert killed
    assert sample_ids(out) == expected_ids(5, prompts=4, group=4)   # every step recorded once, each with its own groups
    events = read_events(out)
    assert [e["event"] for e in events if e["event"] in ("actor_failed", "train_group_restart")] == [
        "actor_failed", "train_group_restart"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["resumes"]) == 1


def test_train_restarts_are_bounded_then_the_run_stops_naming_the_key(tmp_path):
    from axrl.ray_executor.recovery import TrainGroupFailed, train_with_recovery
    from axrl.ray_executor.train_group import TrainGroupLost

    calls = []
    def dies(resume):
        calls.append(resume)
        (tmp_path / "r").mkdir(exist_ok=True)
        raise TrainGroupLost("a train rank died (ActorDiedError)")
    with pytest.raises(TrainGroupFailed, match=r"runtime.ray.train_restarts=1"):
        train_with_recovery(tmp_path / "r", False, dies, max_restarts=1)
    assert calls == [False, True]   # the first attempt, then one resume from the checkpoint
    assert [e["event"] for e in read_events(tmp_path / "r")] == ["train_group_restart", "run_stopped"]


def test_an_engine_that_keeps_dying_stops_the_run_naming_the_key(cluster, tmp_path):
    from axrl.rollout.pool import PoolFailure

    out, killed = tmp_path / "run", []
    import threading

    killer = threading.Thread(target=kill_when, args=(out, "engine", 1, killed), daemon=True)
    killer.start()
    with pytest.raises(PoolFailure, match=r"runtime.ray.engine_restarts=0"):
        train(cfg("runtime.executor=ray", "steps=5", "rollout.max_new_tokens=48", "rollout.group_size=4",
                  "data.prompts_per_step=4", "runtime.ray.heartbeat_s=0.05", "runtime.ray.engine_restarts=0"), out)
    assert killed and [e["event"] for e in read_events(out)][-1] == "actor_failed"


def test_data_parallel_ranks_sum_to_the_one_process_gradient_and_stay_identical(cluster):
    """Two ranks, each with half the samples, against one in-process backend on the whole batch:
    the same grad norm and the same weights after the update (to rounding), identical ranks."""
    import torch

    from axrl.assembly.build import make_tokenizer, make_train_backend, policy_loss
    from axrl.assembly.settings import run_settings
    from axrl.runtime.recording.events import EventLog
    from axrl.ray_executor.executor import RayExecutor
    from axrl.train.protocol import PackedBatch

    c = cfg("runtime.executor=ray", "runtime.ray.train_ranks=2", *SMALL, "train.lr=1e-2")
    local = make_train_backend(c, make_tokenizer(c))
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 7, 4, 8]
    T = sum(lengths)
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    mask = torch.ones(T)
    mask[offsets[:-1]] = 0
    batch = PackedBatch(input_ids=torch.randint(0, 200, (T,), generator=g), offsets=offsets, loss_mask=mask,
                        advantages=torch.randn(T, generator=g))
    old = local.forward(batch).logprobs
    batch = PackedBatch(**{**batch.__dict__, "old_logprobs": old, "rollout_logprobs": old})
    executor = RayExecutor(run_settings(c), c.runtime.ray, EventLog())
    try:
        group = executor.start_train_group()
        before = group.fingerprint()
        assert group.fingerprint() == local.fingerprint()
        stats = []
        for backend in (local, group):
            backend.forward_backward(batch, policy_loss(c))
            stats.append(backend.optimizer_step())
        assert stats[0].grad_norm > 0 and stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-5)
        ranks = group.fingerprints()
        assert ranks[0] == ranks[1] != before
        after_local, after_group = local.forward(batch).logprobs, group.forward(batch).logprobs
        assert (after_local - old).abs().max() > 1e-3           # the update moved the policy …
        torch.testing.assert_close(after_group, after_local, atol=1e-5, rtol=0)   # … the same way
        # Each rank fetched its own token-balanced half (samples 0-2: 17 tokens; 3-5: 19), once for
        # forward_backward and once for forward: not the whole batch, not the other rank's half.
        from axrl.ray_executor.handles import payload_bytes

        halves = [payload_bytes(batch.select([0, 1, 2])), payload_bytes(batch.select([3, 4, 5]))]
        assert halves[0] != halves[1] and group.fetched_bytes() == [2 * n for n in halves]
    finally:
        executor.train_group.close()
        executor.close()


def test_killed_rollout_actor_managing_servers_gets_its_ports_back(cluster, tmp_path):
    """The rollout actor that manages the rollout servers (`rollout.engine: sglang`) is killed
    mid-run: the new actor starts its server on the same port, re-synced to the last weights, and
    every step's samples are there once. (`axrl serve` also exits by itself when its launcher
    dies; a server that does not — SGLang's — is stopped by the next launcher from its claim:
    test_sglang_client.py::test_a_killed_launchers_servers_are_stopped_by_the_next_launcher.)"""
    from axrl.inference.sglang.launcher import free_port

    port = free_port()
    sglang = ["rollout.engine=sglang", "rollout.sglang.server=axrl", f"rollout.sglang.base_port={port}", *SMALL]
    out, killed = run_with_kill(tmp_path, "rollout worker", *sglang)
    assert killed
    assert sample_ids(out) == expected_ids(5, prompts=4, group=4)
    events = read_events(out)
    restarts = [e for e in events if e["event"] == "actor_restarted"]
    assert len(restarts) == 1 and restarts[0]["component"] == "rollout worker"
    started = [e["servers"] for e in events if e["event"] == "actors_started" and e["component"] == "engine"]
    assert started == [[f"http://127.0.0.1:{port}"]] * 2  # the restarted actor's server took the same port
