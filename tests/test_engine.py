"""Tests for axrl.inference.EmbeddedEngine: parity with Hugging Face and with the model's own full
forward (tokens, logprobs, routing), continuous batching, seeded sampling, finish reasons, abort,
weight updates, input validation and the async API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
import pytest
import torch

from axrl.inference import EmbeddedEngine, GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from axrl.model import build_model, hf_state_dict, preset_config, save_hf
from axrl.tokenizer import Tokenizer

torch.set_num_threads(1)

PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 11], [7]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _wait_until(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the engine")
        time.sleep(0.0005)


def _full_forward(model, ids: list[int]):
    with torch.inference_mode():
        return model(torch.tensor([ids]), return_routing=True)


@pytest.fixture(scope="module")
def moe_model():
    return build_model(preset_config("micro-moe"), seed=0)


@pytest.fixture(scope="module")
def dense_model():
    return build_model(preset_config("tiny-dense"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(moe_model):
    with EmbeddedEngine(moe_model, max_batch_size=8, max_seq_len=96) as engine:
        yield engine


@pytest.fixture(scope="module")
def dense_engine(dense_model):
    with EmbeddedEngine(dense_model, max_batch_size=8, max_seq_len=96) as engine:
        yield engine


@pytest.fixture(params=["moe", "dense"])
def model_and_engine(request, moe_model, dense_model, moe_engine, dense_engine):
    return (moe_model, moe_engine) if request.param == "moe" else (dense_model, dense_engine)


def test_implements_protocol(moe_engine):
    assert isinstance(moe_engine, InferenceEngine)
    h = moe_engine.health()
    assert h["ok"] and {"weight_version", "running", "waiting"} <= set(h)


# -- parity ------------------------------------------------------------------------------------
def test_greedy_matches_hf_generate(model_and_engine, tmp_path):
    import transformers  # the test extra installs it
    model, engine = model_and_engine
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    results = engine.generate_batch([GenerateRequest(p, GREEDY) for p in PROMPTS])
    for prompt, res in zip(PROMPTS, results):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        assert res.output_ids == out[0, len(prompt):].tolist()
        assert res.finish_reason == {"type": "length", "length": 12}
        assert res.prompt_tokens == len(prompt) and res.weight_version == 0


def _logprob_diffs(model, prompt: list[int], res: GenerateResult, temperature: float) -> float:
    logits = _full_forward(model, prompt + res.output_ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    ref = torch.log_softmax(logits / t, dim=-1)
    ref = [ref[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(res.output_ids)]
    assert len(res.output_logprobs) == len(res.output_ids)
    return max(abs(a - b) for a, b in zip(ref, res.output_logprobs))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 40, 0.9)])
def test_logprobs_match_full_forward(model_and_engine, temperature, top_k, top_p, record_property):
    model, engine = model_and_engine
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p,
                        ignore_eos=True, seed=11)
    results = engine.generate_batch([GenerateRequest(p, sp, return_logprob=True) for p in PROMPTS])
    diff = max(_logprob_diffs(model, p, r, temperature) for p, r in zip(PROMPTS, results))
    record_property("logprob_max_abs_diff", diff)
    print(f"\nlogprob max |engine - full forward| ({model.config.model_type}, T={temperature}, "
          f"top_k={top_k}, top_p={top_p}): {diff:.3e}")
    assert diff < 1e-4
    if top_k > 0:  # the sampled tokens respect the filter (logprobs are pre-filter, tokens are not)
        for p, r in zip(PROMPTS, results):
            logits = _full_forward(model, p + r.output_ids).logits[0]
            for i, tok in enumerate(r.output_ids):
                rank = int((logits[len(p) - 1 + i] > logits[len(p) - 1 + i, tok]).sum())
                assert rank < top_k


def test_reference_decode_path_agrees(moe_model):
    """decode_impl="model" (the model's own forward over the cache) vs the fused fast path."""
    reqs = lambda: [GenerateRequest(p, GREEDY, return_logprob=True, return_routed_experts=True) for p in PROMPTS]
    with EmbeddedEngine(moe_model, max_batch_size=4, max_seq_len=64, decode_impl="model") as ref_engine:
        ref = ref_engine.generate_batch(reqs())
    with EmbeddedEngine(moe_model, max_batch_size=4, max_seq_len=64) as engine:
        fused = engine.generate_batch(reqs())
    for a, b in zip(ref, fused):
        assert a.output_ids == b.output_ids
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


def test_fused_prefill_matches_model_forward(moe_model):
    """The fused prefill (packed tokens, padded attention) vs the model's own forward writing the
    same slots: cache contents, last-token hidden states and routing. Slots not contiguous."""
    from axrl.inference.embedded.decode import FusedDecoder
    from axrl.inference.embedded.kv_cache import StaticKVCache
    cfg = moe_model.config
    prompts, slots = [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [5, 1, 2]
    make_cache = lambda: StaticKVCache(cfg.num_hidden_layers, 8, cfg.num_key_value_heads, 32, cfg.head_dim)
    fused_cache, ref_cache = make_cache(), make_cache()
    with torch.inference_mode():
        hidden, routing = FusedDecoder(moe_model, 32, 8).prefill(prompts, slots, fused_cache, True)
        lens = [len(p) for p in prompts]
        ids = torch.tensor([p + [0] * (max(lens) - len(p)) for p in prompts])
        mask = torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]
        ref = moe_model(ids, attention_mask=mask, kv_cache=ref_cache.prefill_writer(torch.tensor(slots)),
                        return_routing=True, compute_logits=False)
    for i, (slot, n) in enumerate(zip(slots, lens)):
        for layer in range(cfg.num_hidden_layers):
            torch.testing.assert_close(fused_cache.k[layer][slot, :, :n], ref_cache.k[layer][slot, :, :n],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fused_cache.v[layer][slot, :, :n], ref_cache.v[layer][slot, :, :n],
                                       atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[i], ref.hidden[i, n - 1], atol=1e-5, rtol=1e-5)
    assert torch.equal(routing, torch.cat([ref.routed_experts[i, :n] for i, n in enumerate(lens)]))


@pytest.mark.parametrize("n", [1, 5, 32])
def test_expert_bags_match_sorted_experts(moe_model, n):
    """The two MoE kernels of the fast path (embedding bags for small batches, sorted grouped GEMMs
    for big ones) compute the same block; the decoder picks by size, both must agree."""
    from axrl.inference.embedded.decode import FusedDecoder
    decoder = FusedDecoder(moe_model, 32, 8)
    w = decoder.layers[0]
    assert n * w.top_k <= decoder.bag_max_rows  # the largest batch the bag kernel takes: 32 here
    h, x = torch.randn(2, n, moe_model.config.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        probs = torch.softmax(torch.nn.functional.linear(h, w.w_router), dim=-1)
        weights, experts = torch.topk(probs, w.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        bags = x + decoder._experts_bags(h, w, weights, experts)
        ref = decoder._experts_sorted(x.clone(), h, w, weights, experts)
        # The model's own block on the same input: same routing, same output up to rounding.
        out, model_experts = moe_model.model.layers[0].mlp(h)
    torch.testing.assert_close(bags, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bags, x + out, atol=1e-5, rtol=1e-5)
    assert torch.equal(experts, model_experts)


def test_big_batch_decode_uses_sorted_experts_and_agrees(moe_model):
    """Enough running requests that a decode step takes the grouped_mm MoE path (more rows than
    the bag kernel's limit); the results must equal the model-forward reference engine."""
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(3 + i % 5)] for i in range(40)]
    reqs = lambda: [GenerateRequest(p, GREEDY, return_logprob=True, return_routed_experts=True) for p in prompts]
    with EmbeddedEngine(moe_model, max_batch_size=40, max_seq_len=32) as engine:
        assert 40 * moe_model.config.num_experts_per_tok > engine._scheduler.decoder.bag_max_rows
        fused = engine.generate_batch(reqs())
    with EmbeddedEngine(moe_model, max_batch_size=40, max_seq_len=32, decode_impl="model") as ref_engine:
        ref = ref_engine.generate_batch(reqs())
    for a, b in zip(ref, fused):
        assert a.output_ids == b.output_ids
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


def test_routed_experts_match_full_forward(moe_model, moe_engine):
    cfg = moe_model.config
    sp = SamplingParams(max_new_tokens=9, temperature=1.0, seed=3, ignore_eos=True)
    reqs = [GenerateRequest(p, sp, return_routed_experts=True) for p in PROMPTS]
    reqs.append(GenerateRequest(PROMPTS[1], sp, return_routed_experts=True, routed_experts_start_len=4))
    results = moe_engine.generate_batch(reqs)
    for req, res in zip(reqs, results):
        ids = req.input_ids + res.output_ids
        ref = _full_forward(moe_model, ids[:-1]).routed_experts[0].numpy()  # the last token is never fed
        assert res.routed_experts.dtype == np.int32
        assert res.routed_experts.shape == (len(ids) - 1 - req.routed_experts_start_len,
                                            cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert np.array_equal(res.routed_experts, ref[req.routed_experts_start_len:])
    # Not asked → None; max_new_tokens=0 → the prompt's rows but the last.
    plain, empty = moe_engine.generate_batch([
        GenerateRequest(PROMPTS[0], sp),
        GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=0), return_routed_experts=True)])
    assert plain.routed_experts is None
    assert empty.output_ids == [] and empty.finish_reason == {"type": "length", "length": 0}
    ref = _full_forward(moe_model, PROMPTS[0]).routed_experts[0, :-1].numpy()
    assert np.array_equal(empty.routed_experts, ref)


def test_dense_model_has_no_routing(dense_engine):
    res = dense_engine.generate_batch([GenerateRequest(PROMPTS[0], GREEDY, return_routed_experts=True)])[0]
    assert res.routed_experts is None


# -- continuous batching and sampling ----------------------------------------------------------------
def test_request_joining_mid_batch_matches_running_alone(moe_model):
    long_sp = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    late = GenerateRequest(PROMPTS[1], GREEDY, return_logprob=True)
    with EmbeddedEngine(moe_model, max_batch_size=4, max_seq_len=128) as engine:
        alone = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY, return_logprob=True)])[0]
        alone_long = engine.generate_batch([GenerateRequest(PROMPTS[0], long_sp)])[0]
        start = engine.health()["generated_tokens"]
        a = engine.submit(GenerateRequest(PROMPTS[0], long_sp))
        b = engine.submit(GenerateRequest(PROMPTS[2], long_sp))
        _wait_until(lambda: engine.health()["generated_tokens"] - start >= 10)
        assert not a.done() and not b.done() and engine.health()["running"] == 2
        joined = engine.submit(late).result(timeout=30)
        assert not a.done()  # it really ran alongside the long ones
        assert a.result(timeout=30).output_ids == alone_long.output_ids
        b.result(timeout=30)
    assert joined.output_ids == alone.output_ids
    assert max(abs(x - y) for x, y in zip(joined.output_logprobs, alone.output_logprobs)) < 1e-5


def test_seeded_sampling_is_batch_invariant(moe_engine):
    sp = lambda seed: SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
    alone = moe_engine.generate_batch([GenerateRequest(PROMPTS[0], sp(123))])[0]
    batch = moe_engine.generate_batch([
        GenerateRequest(PROMPTS[1], sp(5)), GenerateRequest(PROMPTS[0], GREEDY),
        GenerateRequest(PROMPTS[0], sp(123)), GenerateRequest(PROMPTS[2], SamplingParams(temperature=0.8, top_k=3)),
        GenerateRequest(PROMPTS[0], sp(124))])
    assert batch[2].output_ids == alone.output_ids
    assert batch[4].output_ids != alone.output_ids
    assert batch[2].output_ids != batch[1].output_ids  # sampling, not greedy


def test_unseeded_sampling_follows_engine_seed_and_submission_order(moe_model):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        with EmbeddedEngine(moe_model, max_batch_size=4, max_seq_len=64, seed=7) as engine:
            runs.append([r.output_ids for r in engine.generate_batch([GenerateRequest(p, sp) for p in PROMPTS])])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][2] or runs[0][0] != runs[0][1]


# -- finish reasons -----------------------------------------------------------------------------------
def test_stop_tokens_eos_and_length(moe_model):
    with EmbeddedEngine(moe_model, max_batch_size=4, max_seq_len=64) as engine:
        full = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0].output_ids
        stop = full[4]
        cut = full.index(stop) + 1
        res = engine.generate_batch([GenerateRequest(PROMPTS[1], SamplingParams(
            max_new_tokens=12, temperature=0.0, stop_token_ids=[stop]))])[0]
        assert res.output_ids == full[:cut] and res.finish_reason == {"type": "stop", "matched": stop}
        short = engine.generate_batch([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=3, temperature=0))])[0]
        assert short.output_ids == full[:3] and short.finish_reason == {"type": "length", "length": 3}
    with EmbeddedEngine(moe_model, max_batch_size=2, max_seq_len=64, eos_token_id=stop) as engine:
        eos = engine.generate_batch([GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=0))])[0]
        assert eos.output_ids == full[:cut] and eos.finish_reason == {"type": "stop", "matched": stop}
        ignored = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0]
        assert ignored.output_ids == full and ignored.finish_type == "length"


def test_max_seq_len_finishes_with_length(moe_model):
    with EmbeddedEngine(moe_model, max_batch_size=2, max_seq_len=16) as engine:
        sp = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
        res = engine.generate_batch([GenerateRequest(list(range(1, 11)), sp, return_routed_experts=True)])[0]
        assert len(res.output_ids) == 6 and res.finish_reason == {"type": "length", "length": 6}
        assert res.routed_experts.shape[0] == 15
        full = engine.generate_batch([GenerateRequest(list(range(1, 17)), sp)])[0]
        assert full.output_ids == [] and full.finish_reason == {"type": "length", "length": 0}
        with pytest.raises(ValueError, match="input_ids.*max_seq_len"):
            engine.submit(GenerateRequest(list(range(1, 18)), sp))


# -- abort, shutdown --------------------------------------------------------------------------------------
def test_abort_running_and_waiting_requests(moe_model):
    long_sp = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
    with EmbeddedEngine(moe_model, max_batch_size=1, max_seq_len=2048) as engine:
        running = engine.submit(GenerateRequest(PROMPTS[0], long_sp, rid="long", return_routed_experts=True,
                                                return_logprob=True))
        waiting = engine.submit(GenerateRequest(PROMPTS[1], GREEDY, rid="queued"))
        nxt = engine.submit(GenerateRequest(PROMPTS[2], GREEDY, rid="next"))
        _wait_until(lambda: engine.health()["generated_tokens"] >= 5)
        assert engine.health()["waiting"] == 2
        assert engine.abort("queued") is True
        q = waiting.result(timeout=5)
        assert q.finish_type == "abort" and q.output_ids == []
        assert engine.abort("long") is True
        r = running.result(timeout=30)
        assert r.finish_type == "abort" and "message" in r.finish_reason
        assert 0 < len(r.output_ids) < 2000 and len(r.output_logprobs) == len(r.output_ids)
        assert r.routed_experts.shape[0] == len(PROMPTS[0]) + len(r.output_ids) - 1
        done = nxt.result(timeout=30)  # the freed slot serves the next request
        assert done.finish_type == "length" and len(done.output_ids) == 12
        assert engine.abort("long") is False and engine.abort("nope") is False
        h = engine.health()
        assert h["running"] == 0 and h["waiting"] == 0


def test_shutdown_aborts_pending_requests(moe_model):
    engine = EmbeddedEngine(moe_model, max_batch_size=1, max_seq_len=4096)
    long_sp = SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
    futures = [engine.submit(GenerateRequest(p, long_sp)) for p in PROMPTS]
    _wait_until(lambda: engine.health()["generated_tokens"] >= 2)
    engine.shutdown()
    results = [f.result(timeout=5) for f in futures]
    assert all(r.finish_type == "abort" for r in results)
    assert not engine.health()["ok"]
    with pytest.raises(RuntimeError):
        engine.submit(GenerateRequest(PROMPTS[0], GREEDY))


# -- weights ---------------------------------------------------------------------------------------------
def test_update_weights_from_state_dict_and_directory(tmp_path):
    cfg = preset_config("micro-moe")
    other = build_model(cfg, seed=1)
    with EmbeddedEngine(build_model(cfg, seed=1), max_batch_size=2, max_seq_len=64) as ref_engine:
        expected_other = ref_engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0].output_ids
    save_hf(build_model(cfg, seed=0), tmp_path / "seed0")
    with EmbeddedEngine(build_model(cfg, seed=0), max_batch_size=2, max_seq_len=64) as engine:
        before = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0]
        assert engine.update_weights(hf_state_dict(other)) == 1 and engine.weight_version == 1
        after = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0]
        assert after.output_ids == expected_other != before.output_ids
        assert after.weight_version == 1 and after.output_weight_versions == [1] * 12
        assert engine.update_weights(tmp_path / "seed0", version=7) == 7
        again = engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0]
        assert again.output_ids == before.output_ids and engine.health()["weight_version"] == 7
        # Bad sources are rejected before anything is copied.
        bad = hf_state_dict(other)
        bad.pop("model.norm.weight")
        with pytest.raises(ValueError, match="model.norm.weight"):
            engine.update_weights(bad)
        bad = hf_state_dict(other)
        bad["model.norm.weight"] = torch.ones(3)
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights(bad)
        save_hf(build_model(preset_config("micro-moe", rope_theta=10_000.0), seed=0), tmp_path / "other_cfg")
        with pytest.raises(ValueError, match="rope_theta"):
            engine.update_weights(tmp_path / "other_cfg")
        assert engine.weight_version == 7
        assert engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0].output_ids == before.output_ids


def test_update_weights_while_a_request_runs(moe_model):
    other = hf_state_dict(build_model(moe_model.config, seed=5))
    long_sp = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    with EmbeddedEngine(build_model(moe_model.config, seed=0), max_batch_size=2, max_seq_len=512,
                        weight_version=3) as engine:
        fut = engine.submit(GenerateRequest(PROMPTS[0], long_sp))
        _wait_until(lambda: engine.health()["generated_tokens"] >= 3)
        assert engine.update_weights(other) == 4
        res = fut.result(timeout=30)
    versions = res.output_weight_versions
    assert len(versions) == 400 and versions[0] == 3 and versions[-1] == 4
    assert versions == sorted(versions) and res.weight_version == 4


# -- validation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(input_ids=[]), "input_ids"),
    (dict(input_ids=[1, 2, 1024]), "input_ids"),
    (dict(input_ids=[1, -1]), "input_ids"),
    (dict(input_ids=[1, "a"]), "input_ids"),
    (dict(input_ids=list(range(1, 98))), "input_ids"),
    (dict(sampling_params=SamplingParams(temperature=-1.0)), "temperature"),
    (dict(sampling_params=SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(sampling_params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(sampling_params=SamplingParams(top_k=0)), "top_k"),
    (dict(sampling_params=SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
    (dict(sampling_params=SamplingParams(stop_token_ids=[5000])), "stop_token_ids"),
    (dict(routed_experts_start_len=-1), "routed_experts_start_len"),
])
def test_bad_requests_raise_value_error_naming_the_field(moe_engine, kwargs, field):
    req = GenerateRequest(**{"input_ids": [1, 2, 3], **kwargs})
    with pytest.raises(ValueError, match=field):
        moe_engine.submit(req)
    assert moe_engine.health()["waiting"] == 0


@pytest.mark.parametrize("kwargs,field", [
    (dict(sampling_params=SamplingParams(max_new_tokens=True)), "sampling_params.max_new_tokens"),
    (dict(sampling_params=SamplingParams(top_k=2.5)), "sampling_params.top_k"),
    (dict(sampling_params=SamplingParams(seed=2 ** 64)), "sampling_params.seed"),
    (dict(sampling_params={"max_new_tokens": 4, "temprature": 0.0}), "sampling_params"),
    (dict(sampling_params="greedy"), "sampling_params"),
    (dict(rid=""), "rid"),
])
def test_a_request_validates_itself_naming_the_field(kwargs, field):
    """The checks live with the request: no engine needed, and the engine raises the same."""
    req = GenerateRequest(**{"input_ids": [1, 2, 3], **kwargs})
    with pytest.raises(ValueError, match=field):
        req.validated(vocab_size=1024)


def test_the_callers_request_is_never_modified(moe_engine):
    """`sampling_params` given as an SGLang-style dict is parsed into a new request inside the
    engine; the caller's object (and its dict) stay exactly as they were."""
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    reqs = [GenerateRequest(list(p), dict(sp), return_logprob=True, rid=f"dict-{i}") for i, p in enumerate(PROMPTS)]
    before = [GenerateRequest(list(r.input_ids), dict(sp), return_logprob=True, rid=r.rid) for r in reqs]
    results = [f.result(timeout=60) for f in moe_engine.submit_many(reqs)]
    one = GenerateRequest([5, 6], dict(sp), rid="dict-one")
    single = asyncio.run(moe_engine.generate(one))
    assert reqs == before and all(type(r.sampling_params) is dict for r in reqs)
    assert one == GenerateRequest([5, 6], dict(sp), rid="dict-one")
    typed = moe_engine.generate_batch([GenerateRequest(list(p), SamplingParams(**sp), return_logprob=True)
                                       for p in PROMPTS])
    assert [r.output_ids for r in results] == [r.output_ids for r in typed]
    assert [r.output_logprobs for r in results] == [r.output_logprobs for r in typed]
    assert len(single.output_ids) == 6


def test_duplicate_rid_in_flight_is_rejected(moe_model):
    with EmbeddedEngine(moe_model, max_batch_size=1, max_seq_len=4096) as engine:
        long_sp = SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
        engine.submit(GenerateRequest(PROMPTS[0], long_sp, rid="x"))
        with pytest.raises(ValueError, match="rid"):
            engine.submit(GenerateRequest(PROMPTS[1], GREEDY, rid="x"))
        engine.abort("x")


# -- async API ---------------------------------------------------------------------------------------------
def test_async_generate_from_several_event_loops_and_threads(moe_engine):
    expected = [r.output_ids for r in moe_engine.generate_batch([GenerateRequest(p, GREEDY) for p in PROMPTS])]

    async def run_all() -> list[list[int]]:
        results = await asyncio.gather(*(moe_engine.generate(GenerateRequest(p, GREEDY)) for p in PROMPTS))
        return [r.output_ids for r in results]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(lambda _: asyncio.run(run_all()), range(3)))
    assert outputs == [expected] * 3
    assert asyncio.run(run_all()) == expected


def test_cancelling_the_awaiting_task_aborts_the_request(moe_model):
    long_sp = SamplingParams(max_new_tokens=4000, temperature=0.0, ignore_eos=True)
    with EmbeddedEngine(moe_model, max_batch_size=1, max_seq_len=4096) as engine:
        async def main() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.generate(GenerateRequest(PROMPTS[0], long_sp, rid="c")), 0.05)
        asyncio.run(main())
        _wait_until(lambda: engine.health()["running"] == 0)
        assert engine.abort("c") is False
        assert len(engine.generate_batch([GenerateRequest(PROMPTS[1], GREEDY)])[0].output_ids) == 12


def test_bf16_model_runs():
    model = build_model(preset_config("micro-moe"), seed=0, dtype=torch.bfloat16)
    with EmbeddedEngine(model, max_batch_size=2, max_seq_len=64) as engine:
        res = engine.generate_batch([GenerateRequest(p, GREEDY, return_logprob=True, return_routed_experts=True)
                                     for p in PROMPTS])
    for p, r in zip(PROMPTS, res):
        assert len(r.output_ids) == 12 and all(np.isfinite(r.output_logprobs))
        assert r.routed_experts.shape[0] == len(p) + 11


@pytest.mark.parametrize("clocked", [False, True])
def test_release_memory_frees_the_kv_cache_and_changes_no_output(clocked):
    """release_memory frees the KV cache and the prefix cache's blocks (what a trainer sharing
    the GPU gets); after resume_memory — or a request, which resumes by itself — the outputs are
    bitwise the outputs without the release. With requests in flight it refuses."""
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    engine = EmbeddedEngine(build_model(cfg, seed=0).eval(), max_batch_size=4, max_seq_len=128,
                            eos_token_id=tok.eos_token_id, clocked=clocked, prefix_cache=True)

    def run(requests):
        futures = engine.submit_many(requests)
        while clocked and not all(f.done() for f in futures):
            engine.step()
        return [(f.result().output_ids, f.result().output_logprobs) for f in futures]

    def batch():
        return [GenerateRequest(input_ids=[1, 2, 3, 4 + i], return_logprob=True,
                                sampling_params=SamplingParams(max_new_tokens=8, temperature=1.0, seed=i))
                for i in range(4)]
    try:
        first = run(batch())
        held = engine.health()["kv_cache_bytes"]
        engine.release_memory()
        assert held > 0 and engine.health()["kv_cache_bytes"] == 0
        engine.resume_memory()
        assert engine.health()["kv_cache_bytes"] == held and run(batch()) == first
        engine.release_memory()
        assert run(batch()) == first
        engine.submit_many([GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=120))])
        with pytest.raises(RuntimeError, match="requests in flight"):
            engine.release_memory()
    finally:
        engine.shutdown()
