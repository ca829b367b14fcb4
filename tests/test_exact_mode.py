"""True on-policy (`rollout.exact: true`, axrl/model/exact.py): the engine's logprobs and MoE routing
are bitwise the trainer's — decode against the KV cache vs one teacher-forced pass, any batch
composition, a multi-turn prefix-cache hit, fp32 and bf16, sync and async runs — and the check
fails when one op is swapped back to its batch-dependent form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl.config import load_config
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.model import build_model, preset_config
from axrl.model import qwen3
from axrl.model.exact import set_exact
from axrl.train.micro_batch import label_logprobs
from axrl_debug.cli import app as debug_app

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _exact_model(dtype: torch.dtype = torch.float32) -> qwen3.Qwen3ForCausalLM:
    return set_exact(build_model(preset_config("tiny-moe"), seed=0).to(dtype).eval(), True)


def _decode_vs_teacher_forced(model: qwen3.Qwen3ForCausalLM) -> tuple[int, float, int]:
    """Three sequences of different lengths: one right-padded teacher-forced pass, and a prefill of
    5 tokens + one-token decode steps over a shared KV cache (the engine's model path). Returns
    (positions whose logits or routing differ, max |Δ logit|, positions compared)."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (37, 20, 51)]
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([s, s.new_zeros(width - len(s))]) for s in seqs])
    lens = torch.tensor([len(s) for s in seqs])
    with torch.no_grad():
        full = model(ids, attention_mask=(torch.arange(width)[None] < lens[:, None]).long(), return_routing=True)
        cache = StaticKVCache(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 64, cfg.head_dim, dtype=dtype)
        P = 5
        outs = {}
        pre = model(ids[:, :P], kv_cache=cache.prefill_writer(torch.arange(3)), return_routing=True)
        for i in range(3):
            for p in range(P):
                outs[i, p] = (pre.logits[i, p], pre.routed_experts[i, p])
        for pos in range(P, width):
            positions = torch.minimum(torch.tensor(pos), lens - 1)
            kv_len = int(positions.max()) + 1
            mask = (torch.arange(kv_len)[None] <= positions[:, None])[:, None, None, :]
            out = model(ids[torch.arange(3), positions][:, None], position_ids=positions[:, None], mask=mask,
                        kv_cache=cache.decode_writer(3, positions, kv_len), return_routing=True)
            for i in range(3):
                if pos < lens[i]:
                    outs[i, pos] = (out.logits[i, 0], out.routed_experts[i, 0])
    bad, worst = 0, 0.0
    for (i, p), (logits, routing) in outs.items():
        worst = max(worst, (logits.float() - full.logits[i, p].float()).abs().max().item())
        bad += int(not (torch.equal(logits, full.logits[i, p]) and torch.equal(routing, full.routed_experts[i, p])))
    return bad, worst, len(outs)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_and_teacher_forced_pass_are_bitwise_equal(dtype):
    bad, worst, n = _decode_vs_teacher_forced(_exact_model(DTYPES[dtype]))
    assert n == 37 + 20 + 51
    assert bad == 0 and worst == 0.0


def test_the_normal_ops_are_not_exact():
    """The premise: without the exact op set decode and the teacher-forced pass differ."""
    model = set_exact(_exact_model(), False)
    bad, worst, _ = _decode_vs_teacher_forced(model)
    assert bad > 0 and worst > 0.0


@pytest.mark.parametrize("swap", ["linear", "attention"])
def test_the_check_fails_when_one_op_is_batch_dependent_again(monkeypatch, swap):
    """Each exact op is needed: put one back to torch's own and the bitwise check catches it."""
    if swap == "linear":
        monkeypatch.setattr(qwen3, "exact_linear", lambda x, w, b=None: F.linear(x, w, b))
    else:
        monkeypatch.setattr(qwen3, "exact_attention", lambda q, k, v, mask, scale: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
    bad, worst, _ = _decode_vs_teacher_forced(_exact_model())
    assert bad > 0 and worst > 0.0


@pytest.mark.parametrize("impl,dtype", [("fused", "float32"), ("fused", "bfloat16"), ("model", "float32")])
def test_engine_multi_turn_with_prefix_cache_matches_the_teacher_forced_forward(impl, dtype):
    """A second turn extends the first turn's sequence: the engine reuses the cached prefix (suffix
    prefill over the slot's K/V), and every sampled token's logprob and the routing of every input
    token equal the exact teacher-forced forward of the whole sequence, bitwise — through the
    engine's fused decoder (what runs) and through the model's own forward."""
    model = _exact_model(DTYPES[dtype])
    ref = _exact_model(DTYPES[dtype])
    temperature = 0.7
    sp = dict(max_new_tokens=12, temperature=temperature, ignore_eos=True)
    with EmbeddedEngine(model, max_batch_size=4, max_seq_len=128, decode_impl=impl, prefix_cache=True,
                        prefix_cache_block=4, seed=3) as engine:
        first = [GenerateRequest(input_ids=list(range(7 + i, 60 + i, 3)), return_logprob=True,
                                 return_routed_experts=True, rid=f"a{i}",
                                 sampling_params=SamplingParams(seed=i, **sp)) for i in range(3)]
        turn1 = engine.generate_batch(first, timeout=300)
        second = [GenerateRequest(input_ids=r.input_ids + o.output_ids + [11, 12, 13], return_logprob=True,
                                  return_routed_experts=True, rid=f"b{i}",
                                  sampling_params=SamplingParams(seed=10 + i, **sp))
                  for i, (r, o) in enumerate(zip(first, turn1))]
        turn2 = engine.generate_batch(second, timeout=300)
    assert all(o.meta["cached_tokens"] > 0 for o in turn2)  # the prefix cache was used
    for req, out in zip(first + second, turn1 + turn2):
        seq = req.input_ids + out.output_ids
        with torch.no_grad():
            full = ref(torch.tensor([seq]), return_routing=True)
        labels = torch.tensor(seq[1:])
        lp, _ = label_logprobs(full.logits[0, :-1], labels, temperature)
        n = len(out.output_ids)
        assert np.array_equal(lp[-n:].float().numpy(), np.array(out.output_logprobs, dtype=np.float32))
        assert np.array_equal(full.routed_experts[0, :-1].numpy(), out.routed_experts.astype(np.int64))


@pytest.mark.parametrize("override,names", [
    ("rollout.engine=sglang", "rollout.engine"), ("train.backend=megatron", "train.backend"),
    ("rollout.weight_dtype=fp8", "rollout.weight_dtype"), ("train.lora={rank: 4}", "train.lora"),
    ("runtime.mode=async", "rollout.partial_rollout")])
def test_config_refuses_what_cannot_be_exact(override, names):
    load_config(QUICKSTART, overrides=["rollout.exact=true"])  # the default run can be exact
    with pytest.raises(Exception) as err:
        load_config(QUICKSTART, overrides=["rollout.exact=true", override])
    assert "rollout.exact" in str(err.value) and names in str(err.value)


SMALL = ["rollout.exact=true", "warmup.steps=10", "data.prompts_per_step=2", "rollout.group_size=4",
         "eval.every=0", "runtime.threads=1", "steps=2", "rollout.max_new_tokens=16"]
RUNS = {
    "fp32": [],
    "bf16": ["model.dtype=bfloat16"],
    "async": ["runtime.mode=async", "rollout.max_staleness=1", "rollout.partial_rollout=recompute",
              "trace.behaviour_logprob=true", "steps=3"],
}


@pytest.fixture(scope="module", params=list(RUNS))
def exact_run(request, tmp_path_factory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param) / "run"
    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in [*SMALL, *RUNS[request.param]]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    return request.param, path


def test_default_run_has_zero_mismatch_and_identical_routing(exact_run):
    """The quickstart (multi-turn calculator, prefix cache on) in exact mode: Δ ≡ 0 on every
    trained token and every routing row agrees; async (η = 1): the engine part of Δ is 0 (the
    trainer under the generating version's weights), whatever the staleness part is."""
    kind, path = exact_run
    assert json.loads((path / "manifest.json").read_text())["extra"]["rollout_exact"] is True
    out = CliRunner().invoke(debug_app, ["mismatch", str(path), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["tokens"]["trained"] > 0
    if kind != "async":
        assert report["metrics"]["max_abs"] == 0.0
        assert report["routing"]["rows"] > 0 and report["routing"]["agreement"] == 1.0
        return
    # async: the engine part of Δ (behaviour_train − rollout, same weights) is exactly 0
    from axrl.trace import TraceReader
    names = ["/tokens/behaviour_train_logprob", "/tokens/rollout_logprob", "/tokens/loss_mask"]
    cols = TraceReader(path).columns(names)
    behaviour, rollout, trained = cols[names[0]], cols[names[1]], cols[names[2]] > 0
    ok = trained & np.isfinite(behaviour)
    assert ok.sum() > 0 and np.array_equal(behaviour[ok], rollout[ok])


def test_service_sample_then_forward_backward_on_the_same_tokens_is_bitwise(tmp_path):
    """The Tinker-compatible service under rollout.exact (axrl serve --training): a sequence its
    sampler returns, sent back to `forward_backward`, gets bitwise the sampler's logprobs on the
    sampled tokens — the importance ratio is exactly 1 before any update."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from axrl.assembly.tinker_api import build_service
    from axrl.inference.serve import ServeConfig
    from axrl.model import save_hf
    from axrl.tinker_api.sampling import BASE, SampleSpec
    from axrl.tinker_api.wire import decode_forward_backward
    from axrl.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model_dir = save_hf(build_model(cfg, seed=0), tmp_path / "moe", tokenizer=tok)
    _app, server, state = build_service(ServeConfig(model_path=str(model_dir)),
                                        load_config(None, ["rollout.exact=true"]), tmp_path / "run")
    try:
        assert server.engine.model.exact
        prompt = tok.encode("what is two plus three")
        spec = SampleSpec(prompt=prompt, num_samples=3, max_tokens=10, temperature=1.0, top_k=-1, top_p=1.0,
                          seed=1, stop_ids=[], stop_strings=[], prompt_logprobs=False)
        seqs = deserialize_sample_response(state.sampler.sample(BASE, spec)).sequences
        model = state.make_model(0, "m", None)
        state.models["m"] = model  # closed by state.close()
        data = []
        for s in seqs:
            full = prompt + list(s.tokens)
            pad = [0.0] * (len(prompt) - 1)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(full[1:]), "logprobs": np.asarray(pad + list(s.logprobs), np.float32),
                "advantages": np.asarray(pad + [1.0] * len(s.tokens), np.float32)}))
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="importance_sampling"), model_id="m", seq_id=0)
        out = deserialize_forward_backward_output(model.forward_backward(
            decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())))
    finally:
        state.close()
        server.engine.shutdown()
    assert len(out.loss_fn_outputs) == len(seqs) == 3
    for s, o in zip(seqs, out.loss_fn_outputs):
        trained = np.asarray(o["logprobs"].tolist(), np.float32)[-len(s.tokens):]
        assert np.array_equal(trained, np.asarray(s.logprobs, np.float32))


def test_black_box_session_through_the_proxy_is_bitwise(tok):
    """An unmodified agent (the OpenAI SDK, two chat calls: the second resends the first reply)
    through the recording proxy to an exact engine with the prefix cache on: every path of the
    stitched session gets, on its generated tokens, bitwise the exact trainer's logprobs, and every
    input token's routing is the trainer's."""
    import asyncio

    import openai

    from axrl.agents.proxy import ProxyServer
    from axrl.agents.tasks import TASKS
    from axrl.rollout.blackbox import AgentSettings, BlackBoxPlayer

    def agent(base_url: str, api_key: str, prompt: str) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(model="m", messages=msgs).choices[0].message.content or ""
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Check it once more."}]
        client.chat.completions.create(model="m", messages=msgs)

    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model, ref = (set_exact(build_model(cfg, seed=0).eval(), True) for _ in range(2))
    temperature = 0.7
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature, stop_token_ids=tok.stop_token_ids, seed=11)
    with EmbeddedEngine(model, max_batch_size=2, max_seq_len=512, prefix_cache=True, prefix_cache_block=4,
                        seed=3) as engine, ProxyServer(tok) as proxy:
        player = BlackBoxPlayer(AgentSettings(function=agent), proxy, max_context_len=512)
        traj = asyncio.run(player.play(engine, sample_id=1, group_id=1, prompt=TASKS["calculator"]().prompt(0, 4),
                                       sampling=sampling, return_routing=True))
    assert traj.status == "ok", traj.error
    paths = [traj, *traj.forks]
    assert sum(p.num_turns for p in paths) >= 2 and all(p.num_generated > 0 for p in paths)
    for path in paths:
        seq = path.token_ids.astype(np.int64)
        with torch.no_grad():
            full = ref(torch.from_numpy(seq)[None], return_routing=True)
        lp, _ = label_logprobs(full.logits[0, :-1], torch.from_numpy(seq[1:]), temperature)
        gen = path.loss_mask[1:] > 0
        assert np.array_equal(lp.float().numpy()[gen], path.rollout_logprob[1:][gen])
        assert np.array_equal(full.routed_experts[0, :-1].numpy(), path.routed_experts[:-1].astype(np.int64))
