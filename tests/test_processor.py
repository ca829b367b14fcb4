"""The reward-to-advantage pipeline and batch building of `AlgorithmProcessor`: DAPO's overlong
penalty and dynamic sampling, advantage clipping and balancing — each against a hand computation —
and the update splits replay shares."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from axrl.algo.processor import AdvantageSettings, informative_groups, overlong_penalty, update_splits
from axrl.assembly.build import make_processor
from axrl.assembly.settings import prompts_to_roll_out
from axrl.config import load_config
from axrl.core.trajectory import Trajectory

torch.set_num_threads(1)


def traj(sample_id: int, group_id: int, reward: float, generated: int, status: str = "ok") -> Trajectory:
    t = Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=f"p{group_id}", reward=reward, status=status)
    t.append([1, 2, 3], generated=False, turn=0)
    t.append(list(range(generated)), generated=True, turn=1, version=0, logprobs=[-0.5] * generated)
    return t


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: free up to 6, then (6 − |y|)/4 down to −1 at 10, −1 beyond
    got = overlong_penalty(np.array([0, 6, 7, 8, 10, 11, 40]), max_len=10, cache_len=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_informative_groups_ignore_failed_samples():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    ok = np.array([True, True, True, True, True, True, True, False])
    # group 3: only one scored sample → no spread → not informative
    assert informative_groups(rewards, groups, ok).tolist() == [False, False, True, True, False, False, False, False]


def test_dynamic_sampling_keeps_the_first_informative_groups():
    cfg = load_config(None, ["data.prompts_per_step=2", "algo.dynamic_sampling={enabled: true, oversample: 2}"])
    assert prompts_to_roll_out(cfg) == 4
    trajs = [traj(0, 10, 1, 3), traj(1, 10, 1, 3),      # all equal: dropped
             traj(2, 11, 0, 3), traj(3, 11, 1, 4),      # kept
             traj(4, 12, 1, 2), traj(5, 12, 0, 5),      # kept
             traj(6, 13, 0, 3), traj(7, 13, 1, 3)]      # informative but surplus
    p = make_processor(cfg)(trajs)
    assert [t.group_id for t in p.trajectories] == [11, 11, 12, 12]
    assert p.dropped_groups == 2 and p.rolled_out_groups == 4
    assert [t.sample_id for t in p.dropped] == [0, 1, 6, 7]   # handed back for the trace, in rollout order
    assert p.batch.num_samples == 4 and p.sample_advantages.abs().sum() > 0
    off = load_config(None, ["data.prompts_per_step=2"])
    assert prompts_to_roll_out(off) == 2 and make_processor(off)(trajs).batch.num_samples == 8


def test_penalty_clip_and_balance_by_hand():
    trajs = [traj(0, 0, 1.0, 2), traj(1, 0, 0.0, 9), traj(2, 0, 0.0, 4), traj(3, 1, 0.0, 3), traj(4, 1, 1.0, 3),
             traj(5, 1, 1.0, 3, status="failed")]
    rewards = np.array([t.reward for t in trajs])
    n = np.array([t.num_generated for t in trajs], dtype=np.float64)
    ok = np.array([t.status == "ok" for t in trajs])
    groups = np.array([t.group_id for t in trajs])

    def grpo(r: np.ndarray) -> np.ndarray:
        out = np.zeros(len(r))
        for g in (0, 1):
            rows = np.flatnonzero((groups == g) & ok)
            x = r[rows]
            out[rows] = (x - x.mean()) / (x.std() + 1e-6)
        return out

    shaped = rewards + overlong_penalty(n, max_len=8, cache_len=4)   # sample 1 (9 tokens) gets −1
    want = np.clip(grpo(shaped), -1.0, 1.0)
    pos, neg = (np.clip(want, 0, None) * n * ok).sum(), (np.clip(-want, 0, None) * n * ok).sum()
    want = np.where(want < 0, want * pos / neg, want)
    settings = AdvantageSettings("grpo", advantage_clip=1.0, advantage_balance=True, overlong=(8, 4))
    got = settings.sample_advantages(rewards, groups, ok, n * ok)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    # balanced: negative token mass = positive token mass
    g = got.numpy().astype(np.float64)
    assert (np.clip(g, 0, None) * n * ok).sum() == pytest.approx((np.clip(-g, 0, None) * n * ok).sum(), rel=1e-5)
    # the processor runs the same pipeline and records the penalty
    cfg = load_config(None, ["algo.advantage_clip=1.0", "algo.advantage_balance=true",
                             "algo.overlong_penalty={max_len: 8, cache_len: 4}"])
    p = make_processor(cfg)(trajs)
    assert torch.equal(p.sample_advantages, got)
    assert p.penalties.tolist()[:2] == [0.0, -1.0]
    with pytest.raises(Exception, match="cache_len"):
        load_config(None, ["algo.overlong_penalty={max_len: 4, cache_len: 4}"])


def test_update_splits_keep_groups_whole():
    assert update_splits([0, 0, 1, 1, 1, 2, 3, 3], 2) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert update_splits([5, 5, 6], 4) == [[0, 1], [2]]
    assert math.isclose(len(update_splits(list(range(9)), 3)[0]), 3)


# ---------------------------------------------------------------------------- dropped groups in the trace
def _ds_run(path):
    from train_util import train

    settings = ["model.preset=micro-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
                "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
                "checkpoint.every=1", "rollout.max_new_tokens=12", "steps=2",
                "algo.dynamic_sampling={enabled: true, oversample: 2}"]
    train(path, settings)
    return path


def test_dynamic_sampling_drops_are_in_the_trace_and_replay_reproduces_them(tmp_path):
    """A dynamic-sampling step rolls out 4 groups and trains 2: the other 2 are in its step file
    under /pool — listed with reason `dynamic_sampling`, their samples (rewards, tokens, logprobs,
    versions, routing) in /pool/samples and /pool/tokens, never in /samples or /train — and rollout
    replay re-generates and compares them bit for bit (a changed pool token is reported)."""
    import shutil

    import h5py

    from axrl.trace import StepFile, TraceReader
    from replay.rollout import replay_rollout, teacher_forced_check

    run = _ds_run(tmp_path / "ds")
    metrics = TraceReader(run).metrics()
    assert [m["dropped_groups"] for m in metrics] == [2, 2]
    with StepFile(run / "trace" / "step_000001.h5") as sf:
        assert sf["/pool/dropped_reason"].tolist() == ["dynamic_sampling"] * 2
        dropped = sf["/pool/dropped_group_id"]
        gids, sids = sf["/pool/samples/group_id"], sf["/pool/samples/sample_id"]
        assert sorted(set(gids.tolist())) == sorted(dropped.tolist()) and len(sids) == 8
        assert not set(gids.tolist()) & set(sf["/samples/group_id"].tolist())
        assert np.isfinite(sf["/pool/samples/reward"]).all()
        off = sf["/pool/samples/offsets"]
        assert off[-1] == len(sf["/pool/tokens/ids"]) == len(sf["/pool/routing/rollout"])
        gen = np.isfinite(sf["/pool/tokens/rollout_logprob"])
        assert gen.any() and (sf["/pool/tokens/policy_version"][gen] == 1).all()
        assert sf["/pool/dropped_min_version"].tolist() == [1, 1]
        # the trained rows are /samples rows only: no pool sample is in any update
        assert len(sf["/samples/sample_id"]) == 8 and int(sf["/train/update_samples"].max()) < 8

    # `axrl-debug summary` reports what the pool left out, per step, from the step files
    import json

    from train_util import debug
    shown = debug("summary", run, "--json")
    assert shown.exit_code == 0, shown.output
    pool = json.loads(shown.output)["pool"]
    with StepFile(run / "trace" / "step_000000.h5") as sf:
        tokens0 = len(sf["/pool/tokens/ids"])
    assert [(r["step"], r["dropped_groups"], r["dropped_by_reason"], r["dropped_samples"]) for r in pool] == \
        [(0, 2, {"dynamic_sampling": 2}, 8), (1, 2, {"dynamic_sampling": 2}, 8)]
    assert pool[0]["dropped_tokens"] == tokens0 > 0
    text = debug("summary", run)
    assert "rollout pool" in text.output and "dynamic_sampling 2" in text.output

    result = replay_rollout(run, 1)
    assert result.verdict == "bitwise-equal", result.first_divergence
    assert result.steps[0].samples == 16    # the 8 trained and the 8 dropped
    tf = teacher_forced_check(run, 1)       # the clock schedule holds the dropped episodes too
    assert tf.fidelity["bitwise_equal"] == tf.fidelity["tokens"] > tf.tokens

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    with h5py.File(copy / "trace" / "step_000001.h5", "r+") as f:
        ids = f["/pool/tokens/ids"]
        t = int(np.flatnonzero(np.isfinite(f["/pool/tokens/rollout_logprob"][:]))[0])
        ids[t] = (int(ids[t]) + 1) % 50
        sample = int(f["/pool/samples/sample_id"][np.searchsorted(f["/pool/samples/offsets"][:], t, "right") - 1])
    changed = replay_rollout(copy, 1)
    assert changed.verdict == "diverged"
    assert changed.first_divergence.sample_id == sample and changed.first_divergence.field == "token_id"
