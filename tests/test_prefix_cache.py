"""The embedded engine's prefix cache: results equal to no cache (greedy tokens, logprobs, routing)
on multi-turn episodes and GRPO groups, `cached_tokens`, eviction under pressure with locked
prefixes kept, abort, and weight updates invalidating the cache; the teacher-forced engine path
(`replay --engine embedded`, `explain`) mirrors a cached run's cache bit for bit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import replay.rollout
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.inference.embedded.prefix_cache import PrefixCache
from axrl.inference.embedded.scheduler import Scheduler
from axrl.model import build_model, hf_state_dict, preset_config
from replay.explain import explain_step
from replay.rollout import teacher_forced_check
from train_util import debug, train

torch.set_num_threads(1)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
#: engine logprobs vs a plain full forward are held to 1e-4 in test_engine.py; cache vs no cache here
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return build_model(preset_config("micro-moe"), seed=0)


def engine(model, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(model, max_batch_size=8, max_seq_len=256, **kw)


def req(prompt, sp=GREEDY, **kw) -> GenerateRequest:
    return GenerateRequest(list(prompt), sp, return_logprob=True, return_routed_experts=True, **kw)


def assert_same(a, b) -> float:
    assert a.output_ids == b.output_ids
    assert np.array_equal(a.routed_experts, b.routed_experts)
    diff = max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs))
    assert diff < LOGPROB_TOL
    return diff


def episode(eng, first: list[int], turns: int, seed: int = 0):
    """A multi-turn episode: each turn's prompt is the previous prompt + its output + new 'env' tokens."""
    rnd = random.Random(seed)
    prompt, results = list(first), []
    for _ in range(turns):
        res = eng.generate_batch([req(prompt)])[0]
        results.append((list(prompt), res))
        prompt = prompt + res.output_ids + [rnd.randrange(1, 1000) for _ in range(rnd.randint(3, 9))]
    return results


def test_multi_turn_reuses_earlier_turns_and_equals_no_cache(model):
    first = list(range(3, 30))
    with engine(model) as cached, engine(model, prefix_cache=False) as plain:
        a, b = episode(cached, first, 6), episode(plain, first, 6)
        diffs = []
        for (prompt, x), (_, y) in zip(a, b):
            diffs.append(assert_same(x, y))
            assert y.meta["cached_tokens"] == 0
        print(f"\nmulti-turn: max |logprob cache - no cache| = {max(diffs):.2e}")
        # Turn t reuses everything of turn t-1 its slot held (prompt + output but the last token),
        # in whole blocks of 16.
        for (prev, r), (prompt, x) in zip(a, a[1:]):
            held = len(prev) + len(r.output_ids) - 1
            assert x.meta["cached_tokens"] == held - held % 16
        assert a[0][1].meta["cached_tokens"] == 0
        assert cached.health()["prefix_cache"]["hit_rate"] > 0.5


def test_grpo_group_shares_the_prompt_prefill(model):
    prompt = [random.Random(1).randrange(1, 1000) for _ in range(70)]
    sp = lambda j: SamplingParams(max_new_tokens=8, temperature=1.0, seed=100 + j, ignore_eos=True)  # noqa: E731
    with engine(model) as cached, engine(model, prefix_cache=False) as plain:
        a = cached.generate_batch([req(prompt, sp(j)) for j in range(8)])
        b = plain.generate_batch([req(prompt, sp(j)) for j in range(8)])
        for x, y in zip(a, b):
            assert_same(x, y)
        # The first sample computes the prompt; the other 7 take its 64 whole-block tokens in the
        # same iteration.
        assert [r.meta["cached_tokens"] for r in a] == [0] + [64] * 7


def test_eviction_under_pressure_stays_correct(model):
    rnd = random.Random(2)
    prompts = [[rnd.randrange(1, 1000) for _ in range(rnd.randint(20, 60))] for _ in range(6)]
    # 4 blocks of 16 tokens: far less than the prompts; every round evicts.
    with engine(model, prefix_cache_tokens=64) as cached, engine(model, prefix_cache=False) as plain:
        for _ in range(3):
            for p in prompts:
                assert_same(cached.generate_batch([req(p)])[0], plain.generate_batch([req(p)])[0])
        stats = cached.health()["prefix_cache"]
        assert stats["evictions"] > 0 and stats["cached_tokens"] <= 64


def make_pool(num_blocks: int) -> tuple[StaticKVCache, PrefixCache]:
    kv = StaticKVCache(num_layers=2, max_batch_size=2, num_kv_heads=1, max_seq_len=64, head_dim=4)
    return kv, PrefixCache(kv, num_blocks=num_blocks, block_size=4)


def test_locked_prefix_is_never_evicted():
    kv, pc = make_pool(3)
    for layer in range(2):
        kv.k[layer][0] = torch.arange(64.0)[None, :, None]
    a = list(range(100, 109))                       # 2 whole blocks + 1 token
    pc.insert(a[:8], slot=0, routing=None)
    m = pc.match(a, need_routing=False)             # a running request holds these 2 blocks
    assert m.num_tokens == 8
    for i in range(5):                              # other prompts compete for the 3rd block
        pc.insert([i] * 8, slot=0, routing=None)
    assert pc.match_length(a, need_routing=False) == 8
    assert pc.evictions >= 4
    # Nothing is evictable but the unlocked leaf: inserting still works and keeps the locked path.
    pc.release(m)
    assert all(n.ref == 0 for n in pc.nodes)
    kv.k[0][1].zero_()
    m = pc.match(a, need_routing=False)
    pc.load(m, slot=1)
    assert torch.equal(kv.k[0][1, :, :8], kv.k[0][0, :, :8])  # the cached K came back intact
    pc.release(m)
    # Once unlocked, the old prefix is the LRU leaf and goes first.
    pc.insert([7] * 12, slot=0, routing=None)
    assert pc.match_length(a, need_routing=False) < 8


def test_full_pool_of_locked_blocks_skips_caching():
    _, pc = make_pool(2)
    pc.insert(list(range(8)), slot=0, routing=None)
    m = pc.match(list(range(9)), need_routing=False)
    pc.insert(list(range(50, 58)), slot=0, routing=None)   # nothing evictable: not cached
    assert pc.match_length(list(range(50, 59)), need_routing=False) == 0
    assert pc.match_length(list(range(9)), need_routing=False) == 8
    pc.release(m)


def test_abort_releases_the_prefix_and_later_requests_agree(model):
    """A running request that holds a cached prefix is aborted mid-generation (a clocked engine, so
    the test decides when): it finishes as "abort" with its partial output, its lock on the prefix
    is released, the prefix stays cached, and a later request over it equals no cache."""
    prompt = list(range(5, 60))
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)

    def run(eng, request):
        fut = eng.submit(request)
        while not fut.done():
            eng.step()
        return fut.result()

    with engine(model, clocked=True) as cached, engine(model, prefix_cache=False) as plain:
        run(cached, req(prompt))                    # caches the prompt's whole blocks
        fut = cached.submit(req(prompt, long, rid="victim"))
        for _ in range(4):                          # admitted over the cached prefix, prefilled, decoding
            cached.step()
        pc = cached._scheduler.prefix_cache
        assert not fut.done() and any(n.ref > 0 for n in pc.nodes)   # running, holding its prefix
        assert cached.abort("victim")
        cached.step()                               # the scheduler finishes it between two iterations
        assert fut.done()
        res = fut.result()
        assert res.finish_type == "abort" and 0 < len(res.output_ids) < 200
        assert res.meta["cached_tokens"] == 48
        assert all(n.ref == 0 for n in pc.nodes)    # no lock outlives its request
        follow = prompt + res.output_ids[:5] + [3, 4, 5]
        again = run(cached, req(follow))
        assert again.meta["cached_tokens"] >= 48    # the released prefix is still served
        assert_same(again, plain.generate_batch([req(follow)])[0])


def test_weight_update_invalidates_the_cache(model):
    other = build_model(preset_config("micro-moe"), seed=1)
    prompt = list(range(10, 60))
    with engine(build_model(preset_config("micro-moe"), seed=0)) as cached, \
            EmbeddedEngine(other, max_batch_size=8, max_seq_len=256, prefix_cache=False) as fresh:
        cached.generate_batch([req(prompt)])
        assert cached.generate_batch([req(prompt)])[0].meta["cached_tokens"] == 48
        cached.update_weights(hf_state_dict(other))
        after = cached.generate_batch([req(prompt)])[0]
        assert after.meta["cached_tokens"] == 0     # nothing computed by the old weights is reused
        assert_same(after, fresh.generate_batch([req(prompt)])[0])
        assert cached.generate_batch([req(prompt)])[0].meta["cached_tokens"] == 48


def test_request_spanning_a_weight_update_is_not_cached(model):
    other = build_model(preset_config("micro-moe"), seed=1)
    prompt = list(range(10, 60))
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    with engine(build_model(preset_config("micro-moe"), seed=0), clocked=True) as eng:
        fut = eng.submit(req(prompt, long))
        eng.step()                                   # admitted and prefilled under version 0
        eng.update_weights(hf_state_dict(other))     # clears the cache
        while not fut.done():
            eng.step()
        assert eng._scheduler.prefix_cache.num_cached_tokens == 0  # its mixed-version K/V stay out


def test_model_decode_path_reuses_the_cache_with_a_suffix_prefill(model):
    """The model's own forward prefills only the uncached suffix (rollout.exact runs this path):
    a second turn hits the cache and greedy decoding gives the same tokens as without a cache."""
    with EmbeddedEngine(model, decode_impl="model", max_seq_len=64) as eng:  # default: off there
        assert eng.health()["prefix_cache"] is None
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    first = list(range(10, 40))
    outs = {}
    for cached in (True, False):
        with EmbeddedEngine(model, decode_impl="model", prefix_cache=cached, prefix_cache_block=4,
                            max_seq_len=64) as eng:
            a = eng.generate_batch([req(first, greedy)], timeout=60)[0]
            b = eng.generate_batch([req(first + a.output_ids + [5, 6], greedy)], timeout=60)[0]
            outs[cached] = (a.output_ids, b.output_ids, b.meta["cached_tokens"])
    assert outs[True][2] > 0 and outs[False][2] == 0
    assert outs[True][:2] == outs[False][:2]


def test_free_slot_between_running_ones_is_not_reused_stale(model):
    """A free slot inside [0, n) is fed a dummy token at position 0 by every decode step: the K/V
    it held from its last request are then stale and must come from the cache again."""
    rnd = random.Random(4)
    prompts = [[rnd.randrange(1, 1000) for _ in range(40)] for _ in range(3)]
    lengths = [40, 3, 40]
    outs = {}
    for cache in (True, False):
        with engine(model, prefix_cache=cache, clocked=True) as eng:
            futs = [eng.submit(req(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)))
                    for p, n in zip(prompts, lengths)]
            while not futs[1].done():
                eng.step()
            for _ in range(5):  # slot 1 idles between two running slots
                eng.step()
            nxt = prompts[1] + futs[1].result().output_ids + [5, 6, 7]
            f = eng.submit(req(nxt))
            while not (f.done() and all(x.done() for x in futs)):
                eng.step()
            outs[cache] = f.result()
    assert outs[True].meta["cached_tokens"] > 0
    assert_same(outs[True], outs[False])


# -- the teacher-forced engine path on a run trained with the cache ----------------------------------
SMALL_RUN = ["steps=2", "model.preset=micro-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
             "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
             "checkpoint.every=1", "rollout.max_new_tokens=12", "rollout.prefix_cache=true"]


@pytest.fixture(scope="module", params=[0, 96], ids=["pool-default", "pool-96-tokens"])
def cached_run(request, tmp_path_factory) -> tuple[Path, dict[int, int], int, int]:
    """A short deterministic multi-turn run (echo, up to 4 turns) trained with the prefix cache,
    the whole pool or one of 6 blocks (evicting); with the prompt tokens its engine's requests took
    from the cache per weight version (= step) and the evictions it made, seen from inside the engine."""
    cached: dict[int, int] = {}
    evictions = [0]
    real = Scheduler.result

    def result(self, seq, reason):
        cached[self.version] = cached.get(self.version, 0) + seq.cached_tokens
        evictions[0] = max(evictions[0], self.prefix_cache.evictions)
        return real(self, seq, reason)

    path = tmp_path_factory.mktemp("cached") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "result", result)
        train(path, [*SMALL_RUN, f"rollout.prefix_cache_tokens={request.param}"])
    return path, cached, evictions[0], request.param


def test_teacher_forced_path_mirrors_the_runs_cache_bit_for_bit(cached_run, monkeypatch):
    run, cached, evictions, pool = cached_run
    assert cached[0] > 0 and cached[1] > 0                  # later turns and group members hit
    assert (evictions > 0) == (pool > 0)                    # the small pool evicted, the default did not
    for step in (0, 1):
        check = teacher_forced_check(run, step)
        f = check.fidelity
        assert f["bitwise_equal"] == f["tokens"] == check.tokens > 0 and f["max_abs_diff"] == 0.0
        # the run's engine's cache decisions: it took as many prompt tokens from the cache
        assert f["cached_prompt_tokens"] == cached[step]
    # what the mirror fixes: prefilling every prompt whole leaves float-rounding differences
    monkeypatch.setattr(replay.rollout, "engine_prefix_cache", lambda cfg: None)
    plain = teacher_forced_check(run, 1).fidelity
    assert plain["cached_prompt_tokens"] == 0 and 0 < plain["max_abs_diff"] < 1e-4
    assert plain["bitwise_equal"] < plain["tokens"]


def test_explain_on_a_cached_run(cached_run):
    run = cached_run[0]
    result = explain_step(run, 1, top=2)
    f = result.fidelity["engine_path_vs_rollout_logprob"]
    assert f["bitwise_equal"] == f["tokens"] > 0 and f["cached_prompt_tokens"] > 0
    assert result.fidelity["trainer_path_reproduces_old_logprob"]
    for tok in result.tokens:
        assert tok.engine_reproduces_rollout and tok.rows[-1].remaining_gap == 0.0
    out = debug("replay", run, "--step", 1, "--rollout", "--engine", "embedded", "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["fidelity"]["bitwise_equal"] == doc["fidelity"]["tokens"] > 0
