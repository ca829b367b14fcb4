"""Rollout plumbing: the deterministic engine clock, the schedule's rules, the persistent pool,
continuations of interrupted requests, per-sample seeds and stream positions."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from axrl.agents.env import Prompt, StepOutcome
from axrl.agents.tasks import get_task
from axrl.core.trajectory import Trajectory
from axrl.data import PromptLoader
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.inference.protocol import ClockedEngine
from axrl.model import build_model, preset_config
from axrl.rollout.episode_engine import continuation, splice
from axrl.rollout.pool import PoolFailure, TrajectoryPool
from axrl.rollout.runner import EpisodeRunner, EpisodeSpec, RolloutSettings, run_all, sample_seed
from axrl.rollout.schedule import Schedule
from axrl.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    tok = Tokenizer.default()
    return build_model(preset_config("micro-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id), seed=0)


def traj(sid: int, gid: int, versions: list[int]) -> Trajectory:
    t = Trajectory(sample_id=sid, group_id=gid, prompt_id=f"p{gid}")
    t.append([1, 2], generated=False, turn=0)
    for v in versions:
        t.append([3], generated=True, turn=1, version=v, logprobs=[-0.5])
    return t


# ---------------------------------------------------------------- schedule

def test_schedule_capacity_and_freshness():
    sync = Schedule("sync", groups_per_step=4)
    assert sync.eta == 0 and sync.capacity(3) == 16 and not sync.sync_at_seal
    assert sync.fresh(5, 5) and not sync.fresh(4, 5) and sync.fresh(None, 5)
    a = Schedule("async", groups_per_step=4, max_staleness=2, clocked=True)
    assert a.capacity(3) == 24 and a.sync_at_seal
    assert a.fresh(3, 5) and not a.fresh(2, 5)
    assert not Schedule("async", 4, 2, clocked=False).sync_at_seal
    with pytest.raises(ValueError, match="max_staleness"):
        Schedule("async", 4, 0)


# ---------------------------------------------------------------- pool

def test_pool_seals_fresh_groups_in_completion_order_and_sorts_them():
    pool = TrajectoryPool(group_size=2)
    for t in [traj(5, 2, [4]), traj(2, 1, [3]), traj(4, 2, [4]), traj(0, 0, [1]), traj(1, 0, [2]), traj(3, 1, [3])]:
        pool.add(t)
    # completion order: group 2, group 0 (version 1: stale for step 4 with eta 2), group 1
    fresh = lambda g: Schedule("async", 2, 2).fresh(g.min_version, 4)  # noqa: E731
    batch, stale = pool.seal(4, 2, fresh)
    assert [g.group_id for g in stale] == [0]
    assert [t.sample_id for t in batch.trajectories] == [2, 3, 4, 5]  # group 1 then 2, samples in order
    assert batch.version_lag().tolist() == [1, 1, 0, 0] and len(pool) == 0


def test_pool_waits_for_enough_groups_and_take_blocks_until_published():
    pool = TrajectoryPool(group_size=1)
    pool.add(traj(0, 0, [0]))
    batch, stale = pool.seal(0, 2, lambda g: True)
    assert batch is None and not stale and pool.num_complete() == 1  # kept for the next attempt
    pool.add(traj(1, 1, [0]))
    batch, _ = pool.seal(0, 2, lambda g: True)
    with pytest.raises(TimeoutError):
        pool.take(0, timeout=0.01)
    pool.publish(batch)
    assert pool.take(0).step == 0
    pool.fail(RuntimeError("engine died"))
    with pytest.raises(PoolFailure, match="engine died"):
        pool.take(1, timeout=1)


def test_pool_rejects_an_overfull_group_and_discards():
    pool = TrajectoryPool(group_size=2)
    pool.add(traj(0, 0, [0]))
    pool.add(traj(1, 0, [0]))
    with pytest.raises(ValueError, match="already has 2"):
        pool.add(traj(1, 0, [0]))
    pool.discard(0)
    assert len(pool) == 0


# ---------------------------------------------------------------- the clock

class SlowEcho:
    """Echo env whose step takes a real, varying time: under the clock, how long an env takes must
    not change what the engine computes."""

    tools: list = []

    def __init__(self, delays: list[float]) -> None:
        self.delays, self.turn = delays, 0

    def reset(self, prompt: Prompt):
        return prompt.as_messages()

    def step(self, action: str) -> StepOutcome:
        time.sleep(self.delays[self.turn % len(self.delays)])
        self.turn += 1
        return StepOutcome([{"role": "user", "content": "again"}], 0.0, self.turn >= 3)


def _clocked_rollout(model, tok, delays: list[float]) -> list[Trajectory]:
    engine = EmbeddedEngine(model, max_batch_size=4, max_seq_len=160, eos_token_id=tok.eos_token_id, clocked=True)
    assert isinstance(engine, ClockedEngine)
    out: list[Trajectory] = []
    settings = RolloutSettings(group_size=3, sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
                               max_turns=3, max_context_len=160, return_routing=True)
    runner = EpisodeRunner(engine, tok, lambda: SlowEcho(delays), settings, clock="iterations",
                           on_done=lambda spec, t: out.append(t))
    specs = [EpisodeSpec(i, i // 3, Prompt(prompt_id=f"q{i // 3}", text=f"say {i // 3}"), sample_seed(0, i))
             for i in range(6)]  # 6 episodes on 4 slots: some wait, and turns end at different iterations
    try:
        asyncio.run(run_all(runner, specs))
    finally:
        engine.shutdown()
    return sorted(out, key=lambda t: t.sample_id)


def test_clocked_rollout_is_bitwise_whatever_the_env_timing(model, tok):
    a = _clocked_rollout(model, tok, [0.0, 0.03, 0.0])
    b = _clocked_rollout(model, tok, [0.02, 0.0, 0.01])
    assert [t.num_turns for t in a] == [3] * 6
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert x.rollout_logprob.tobytes() == y.rollout_logprob.tobytes()
        assert np.array_equal(x.routed_experts, y.routed_experts)


def test_clocked_engine_steps_only_when_told(model, tok):
    engine = EmbeddedEngine(model, max_batch_size=2, max_seq_len=64, clocked=True)
    fut = engine.submit_many([GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                         ignore_eos=True))])[0]
    assert not fut.done() and engine.health()["waiting"] == 1
    steps = 0
    while engine.step():
        steps += 1
    # iteration 1: prefill (first token) + a decode step; iteration 2: the third token
    assert len(fut.result().output_ids) == 3 and steps == 2
    assert engine.update_weights(dict(model.state_dict()), version=4) == 4  # applied at once, in this thread
    engine.shutdown()


# ---------------------------------------------------------------- continuations (partial rollout: recompute)

def test_an_interrupted_request_resumes_as_if_uninterrupted(model):
    """Abort mid-decode, continue from the partial output: greedy tokens equal the uninterrupted
    request's, logprobs within the engine's prefill-vs-decode tolerance, routing rows line up."""
    engine = EmbeddedEngine(model, max_batch_size=2, max_seq_len=96, clocked=True)
    req = GenerateRequest([5, 17, 300, 42, 9], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
                          return_logprob=True, return_routed_experts=True, routed_experts_start_len=2)
    whole = engine.submit_many([req])[0]
    while engine.step():
        pass
    whole = whole.result()
    again = GenerateRequest(list(req.input_ids), req.sampling_params, True, True, 2)
    fut = engine.submit_many([again])[0]
    for _ in range(5):
        engine.step()
    engine.abort(again.rid)
    engine.step()
    partial = fut.result()
    assert partial.finish_type == "abort" and 0 < len(partial.output_ids) < 12
    cont = continuation(again, partial, part=1)
    assert cont.input_ids == again.input_ids + partial.output_ids and cont.rid != again.rid
    assert cont.sampling_params.max_new_tokens == 12 - len(partial.output_ids)
    rest = engine.submit_many([cont])[0]
    while engine.step():
        pass
    joined = splice(partial, rest.result())
    assert joined.output_ids == whole.output_ids and joined.finish_reason == whole.finish_reason
    assert np.allclose(joined.output_logprobs, whole.output_logprobs, atol=2e-5)
    assert joined.routed_experts.shape == whole.routed_experts.shape
    assert len(joined.output_weight_versions) == len(joined.output_ids)
    engine.shutdown()


# ---------------------------------------------------------------- identity

def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(0, 17) == sample_seed(0, 17)
    assert len({sample_seed(s, i) for s in range(3) for i in range(200)}) == 600


def test_prompt_at_is_the_stream_position(tmp_path):
    task = PromptLoader.from_task(get_task("arithmetic"), seed=3)
    seq = task.next_batch(5)
    assert [task.prompt_at(i).prompt_id for i in range(5)] == [p.prompt_id for p in seq] and task.position == 5
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(4)))
    files = PromptLoader.from_file(path, seed=1)
    seq = files.next_batch(10)  # 2.5 epochs, each a permutation of its own
    assert [files.prompt_at(i).prompt_id for i in range(10)] == [p.prompt_id for p in seq]
    assert files.position == 10
