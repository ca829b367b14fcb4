"""Low-precision rollout (`rollout.weight_dtype`, `rollout.precision`, `rollout.kv_dtype`;
axrl.inference.quant): the block-fp8 and per-token-group activation quantisers against independent
references, the engine's logprobs under fp8 weights / W8A8 / KV (plausibly off fp32, still
deterministic), the precision recorded in the run, rollout replay bitwise with fp8 and W8A8, and
the refusals (fp8 SGLang on CPU, W8A8 with bf16 weights or the model's own forward)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl.assembly.settings import sglang_settings
from axrl.config import load_config
from axrl.core.errors import ConfigError
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.inference.quant import (BLOCK, FP8_MAX, apply_rollout_precision, dequantise_fp8, fp8_round_act,
                                  fp8_round_rows, is_quantised, quantise_act_fp8, quantise_fp8)
from axrl.model import build_model, hf_state_dict, preset_config
from axrl_debug.cli import app as debug_app
from replay.rollout import replay_rollout, teacher_forced_check

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
# e4m3 has 3 mantissa bits: round-to-nearest is within 2^-4 relative of a normal value.
E4M3_REL = 2.0 ** -4


def _reference_block(w: np.ndarray) -> tuple[np.ndarray, float]:
    """One block quantised by hand: scale = amax / 448, values rounded to the nearest e4m3 number
    (3 mantissa bits; subnormals below 2^-6 in steps of 2^-9) — written without torch's fp8."""
    amax = float(np.abs(w).max())
    scale = amax / 448.0 if amax > 0 else 1.0
    x = w / scale
    mag = np.abs(x)
    exp = np.floor(np.log2(np.maximum(mag, 2.0 ** -6)))
    step = 2.0 ** (exp - 3)
    q = np.sign(x) * np.round(mag / step) * step  # numpy rounds half to even, as the cast does
    return q, scale


def test_block_scales_and_values_match_an_independent_reference():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)[None, :]  # uneven magnitudes
    w[:128, 128:] = 0.0  # an all-zero block
    q, scale = quantise_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (3, 2)
    wn = w.double().numpy()
    for bi in range(3):
        for bj in range(2):
            block = wn[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK]
            ref_q, ref_scale = _reference_block(block)
            assert scale[bi, bj].item() == pytest.approx(ref_scale, rel=1e-6)
            got = q[bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK].float().double().numpy()
            # equal except where float32's division lands a hair to the other side of a tie
            assert np.mean(got == ref_q) > 0.999
    assert scale[0, 1].item() == 1.0 and q[:128, 128:].float().abs().max().item() == 0.0


def test_round_trip_error_is_within_the_e4m3_bound():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=gen) * 0.02
    q, scale = quantise_fp8(w)
    back = dequantise_fp8(q, scale)
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    err = (back - w).abs()
    # normal range: relative 2^-4; below the smallest normal (2^-6 · scale): absolute 2^-10 · scale
    bound = torch.maximum(w.abs() * E4M3_REL, full * 2.0 ** -10) * (1 + 1e-5)
    assert bool((err <= bound).all())
    assert (back.abs().amax() <= w.abs().amax() * (1 + 1e-6)).item()
    assert 0 < err.mean().item() < 0.05 * w.abs().mean().item()  # it is lossy, and not wildly so
    # each block's largest value is representable exactly (scaled to ±448)
    assert q.float().abs().amax().item() == FP8_MAX


def test_kv_rows_round_per_token_and_head():
    x = torch.randn(2, 4, 7, 32, generator=torch.Generator().manual_seed(2))
    r = fp8_round_rows(x)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(r.abs().amax(-1, keepdim=True), amax, rtol=1e-6)
    assert bool(((r - x).abs() <= torch.maximum(x.abs() * E4M3_REL, amax / FP8_MAX * 2.0 ** -9) * 1.0001).all())


def test_which_weights_are_quantised():
    names = hf_state_dict(build_model(preset_config("micro-moe"), seed=0)).keys()
    chosen = {n for n in names if is_quantised(n)}
    assert "model.layers.0.self_attn.q_proj.weight" in chosen
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in chosen
    dense = hf_state_dict(build_model(preset_config("tiny-dense"), seed=0)).keys()
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight"} <= {n for n in dense if is_quantised(n)}
    for kept in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert kept in names and kept not in chosen


def _logprobs(model, weight_dtype: str = "fp32", kv_dtype: str = "auto", source=None,
              precision: str = "auto") -> list[list[float]]:
    prompts = [[5, 17, 300, 42, 9], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 11]]
    with EmbeddedEngine(model, max_batch_size=4, max_seq_len=64, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                        seed=3, precision=precision) as engine:
        if source is not None:
            engine.update_weights(source)
        reqs = [GenerateRequest(input_ids=p, sampling_params=SamplingParams(max_new_tokens=16, temperature=1.0,
                                                                            ignore_eos=True, seed=i),
                                return_logprob=True, rid=f"r{i}") for i, p in enumerate(prompts)]
        return [r.output_logprobs for r in engine.generate_batch(reqs, timeout=120)]


def _tf_logprobs(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """log p of each next token under `model`'s full forward (fp32 reference on the same tokens)."""
    out = []
    with torch.inference_mode():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
            out.append(lp[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy())
    return out


@pytest.mark.parametrize("weight_dtype,kv_dtype", [("fp8", "auto"), ("bf16", "auto"), ("fp32", "fp8")])
def test_low_precision_engine_is_off_fp32_plausibly_and_deterministic(weight_dtype, kv_dtype):
    base = build_model(preset_config("tiny-moe"), seed=0)
    sd = {k: v.clone() for k, v in hf_state_dict(base).items()}
    a = _logprobs(build_model(preset_config("tiny-moe"), seed=0), weight_dtype, kv_dtype)
    b = _logprobs(build_model(preset_config("tiny-moe"), seed=0), weight_dtype, kv_dtype)
    assert a == b  # same seed, same bits
    ref = _logprobs(build_model(preset_config("tiny-moe"), seed=0))
    assert a != ref
    # a weight sync quantises the trainer's weights the same way as the initial model
    assert _logprobs(build_model(preset_config("tiny-moe"), seed=1), weight_dtype, kv_dtype, source=sd) == a
    # Later sampled tokens may diverge; the first ones are the same token under both precisions.
    first = np.abs(np.array([x[0] - y[0] for x, y in zip(a, ref)]))
    assert 0 < first.max() < 0.5
    # the caller's state dict is not quantised in place
    assert base.model.layers[0].self_attn.q_proj.weight.equal(sd["model.layers.0.self_attn.q_proj.weight"])


def test_fp8_mismatch_ordering_against_the_fp32_policy():
    """On the same tokens: fp8 weights are further from the fp32 policy than bf16 weights, and
    both are small compared with the logprobs themselves."""
    model = build_model(preset_config("tiny-moe"), seed=0)
    seqs = [list(range(7, 300, 5)), list(range(900, 20, -13))]
    ref = np.concatenate(_tf_logprobs(model, seqs))
    gaps = {}
    for dt in ("bf16", "fp8"):
        m = apply_rollout_precision(build_model(preset_config("tiny-moe"), seed=0), dt)
        gaps[dt] = float(np.mean(np.abs(np.concatenate(_tf_logprobs(m, seqs)) - ref)))
    assert 0 < gaps["bf16"] < gaps["fp8"] < 0.05 * float(np.mean(np.abs(ref)))


SMALL = ["model.preset=micro-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
         "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
         "checkpoint.every=1", "rollout.max_new_tokens=12", "steps=2"]


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8") / "run"
    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in [*SMALL, "rollout.weight_dtype=fp8", "rollout.kv_dtype=fp8"]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    return path


def test_the_run_records_its_rollout_precision(fp8_run):
    extra = json.loads((fp8_run / "manifest.json").read_text())["extra"]
    assert extra["rollout_weight_dtype"] == "fp8" and extra["rollout_kv_dtype"] == "fp8"
    out = CliRunner().invoke(debug_app, ["summary", str(fp8_run), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["rollout_precision"] == {"weight_dtype": "fp8", "kv_dtype": "fp8",
                                                           "precision": "auto"}
    out = CliRunner().invoke(debug_app, ["summary", str(fp8_run)])
    assert "rollout precision: weights fp8, KV cache fp8" in out.output


def test_fp8_rollout_replays_bitwise(fp8_run, tmp_path):
    result = replay_rollout(fp8_run, 1)
    assert result.verdict == "bitwise-equal", result.first_divergence
    # the teacher-forced engine path (replay --rollout --engine embedded, explain) applies the same
    # precision: it reproduces the fp8 engine's logprobs bit for bit, and the gap is the trainer's
    tf = teacher_forced_check(fp8_run, 1, top=3)
    assert tf.tokens > 0 and tf.summary["max_abs_embedded_vs_recorded"] == 0.0
    assert tf.summary["mean_abs_trainer_vs_recorded"] > 0
    # the precision is what makes it bitwise: replayed in fp32, the same step diverges
    copy = tmp_path / "as_fp32"
    shutil.copytree(fp8_run, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["rollout"].update(weight_dtype="fp32", kv_dtype="auto")
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert replay_rollout(copy, 1).verdict == "diverged"


def test_fp8_sglang_is_refused_on_cpu():
    sglang = ["rollout.engine=sglang", "rollout.clock=rounds"]
    with pytest.raises(ConfigError, match=r"rollout\.weight_dtype: fp8 with rollout\.engine: sglang needs a GPU"):
        load_config(QUICKSTART, [*sglang, "rollout.weight_dtype=fp8"])
    with pytest.raises(ConfigError, match=r"rollout\.kv_dtype"):
        load_config(QUICKSTART, [*sglang, "rollout.kv_dtype=fp8"])
    # on a GPU the server gets its own fp8 path
    cfg = load_config(QUICKSTART, [*sglang, "rollout.weight_dtype=fp8", "runtime.device=cuda"])
    assert sglang_settings(cfg).server_args[-2:] == ["--quantization", "fp8"]


# -- W8A8: fp8 activations (rollout.precision: fp8_w8a8) ------------------------------------------

def test_activation_quantiser_matches_a_per_token_reference():
    """Per token (rows of <= 128 channels): scale = amax / 448, values rounded to the nearest e4m3
    number — checked by hand on exact cases and against the numpy reference on random rows."""
    x = torch.tensor([[448.0, 1.0, 0.5, -3.0],     # amax 448: scale 1, every value exact in e4m3
                      [896.0, 3.3, -0.0, 7.0],     # scale 2: 3.3/2 = 1.65 → 1.625 (step 1/8) → 3.25
                      [0.0, 0.0, 0.0, 0.0]])       # all zero: stays zero (scale floored, no NaN)
    q, scale = quantise_act_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert scale[:2, 0].tolist() == [1.0, 2.0]
    assert fp8_round_act(x).tolist() == [[448.0, 1.0, 0.5, -3.0], [896.0, 3.25, 0.0, 7.0], [0.0, 0.0, 0.0, 0.0]]
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(16, 96, generator=gen) * torch.logspace(-4, 2, 16)[:, None]
    got, (_, sc) = fp8_round_act(rows).double().numpy(), quantise_act_fp8(rows)
    for i, row in enumerate(rows.double().numpy()):
        ref_q, ref_scale = _reference_block(row)
        assert sc[i, 0].item() == pytest.approx(ref_scale, rel=1e-6)
        np.testing.assert_allclose(got[i], ref_q * ref_scale, rtol=1e-6, atol=0)


def test_activation_scales_are_per_group_of_128_channels():
    """A token's 256 channels get two scales (SGLang's/vLLM's group_size 128): the small group keeps
    its precision instead of flushing to zero under the large group's scale; bf16 keeps its dtype."""
    x = torch.cat([torch.full((1, 128), 1000.0), torch.full((1, 128), 1e-3)], dim=1)
    x[0, 200] = 2e-3
    _, scale = quantise_act_fp8(x)
    assert scale.shape == (1, 2) and scale[0].tolist() == pytest.approx([1000 / FP8_MAX, 2e-3 / FP8_MAX])
    back = fp8_round_act(x)
    assert back[0, 200].item() == pytest.approx(2e-3, rel=1e-6)
    assert abs(back[0, 130].item() - 1e-3) <= E4M3_REL * 1e-3
    assert fp8_round_act(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_w8a8_engine_is_off_fp32_plausibly_deterministic_and_not_weights_only():
    model = lambda seed=0: build_model(preset_config("tiny-moe"), seed=seed)  # noqa: E731
    sd = {k: v.clone() for k, v in hf_state_dict(model()).items()}
    a = _logprobs(model(), precision="fp8_w8a8")
    assert _logprobs(model(), precision="fp8_w8a8") == a  # same seed, same bits
    assert _logprobs(model(), "fp8", precision="fp8_w8a8") == a  # fp8_w8a8 means fp8 weights anyway
    ref, weights_only = _logprobs(model()), _logprobs(model(), "fp8")
    assert a != ref and a != weights_only  # the activations are quantised too
    assert _logprobs(model(seed=1), source=sd, precision="fp8_w8a8") == a  # a weight sync quantises alike
    first = np.abs(np.array([x[0] - y[0] for x, y in zip(a, ref)]))
    assert 0 < first.max() < 0.5


def _engine_gap(precision: str, weight_dtype: str, seqs: list[list[int]]) -> float:
    """Mean |engine logprob - fp32 full-forward logprob| over tokens the engine generated."""
    model = build_model(preset_config("tiny-moe"), seed=0)
    with EmbeddedEngine(build_model(preset_config("tiny-moe"), seed=0), max_batch_size=8, max_seq_len=96,
                        weight_dtype=weight_dtype, precision=precision, seed=5) as engine:
        reqs = [GenerateRequest(input_ids=p, sampling_params=SamplingParams(max_new_tokens=24, temperature=1.0,
                                                                            ignore_eos=True, seed=i),
                                return_logprob=True, rid=f"g{i}") for i, p in enumerate(seqs)]
        res = engine.generate_batch(reqs, timeout=300)
    gaps = []
    for p, r in zip(seqs, res):
        ref = _tf_logprobs(model, [p + r.output_ids])[0][len(p) - 1:]
        gaps.append(np.abs(np.array(r.output_logprobs) - ref))
    return float(np.mean(np.concatenate(gaps)))


def test_w8a8_gap_is_larger_than_weights_only():
    """Against the fp32 policy on the tokens each engine generated: fp32 engine (rounding only) <
    fp8 weights < W8A8 — and W8A8 stays small next to the logprobs."""
    seqs = [[5 + 37 * i + j for j in range(6 + i)] for i in range(6)]
    fp32, fp8, w8a8 = (_engine_gap("auto", "fp32", seqs), _engine_gap("auto", "fp8", seqs),
                       _engine_gap("fp8_w8a8", "fp32", seqs))
    assert fp32 < 1e-4 < fp8 < w8a8 < 0.5


def test_w8a8_refusals_name_the_keys():
    with pytest.raises(ConfigError, match=r"rollout\.precision: fp8_w8a8 .* rollout\.weight_dtype: bf16"):
        load_config(QUICKSTART, ["rollout.precision=fp8_w8a8", "rollout.weight_dtype=bf16"])
    with pytest.raises(ConfigError, match=r"rollout\.precision: fp8_w8a8 with rollout\.engine: sglang needs a GPU"):
        load_config(QUICKSTART, ["rollout.engine=sglang", "rollout.clock=rounds", "rollout.precision=fp8_w8a8"])
    cfg = load_config(QUICKSTART, ["rollout.engine=sglang", "rollout.clock=rounds", "rollout.precision=fp8_w8a8",
                                   "runtime.device=cuda"])
    assert sglang_settings(cfg).server_args[-2:] == ["--quantization", "fp8"]
    with pytest.raises(ValueError, match="decode_impl='fused'"):
        EmbeddedEngine(build_model(preset_config("tiny-moe"), seed=0), decode_impl="model", precision="fp8_w8a8",
                       clocked=True)


@pytest.fixture(scope="module")
def w8a8_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("w8a8") / "run"
    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in [*SMALL, "rollout.precision=fp8_w8a8"]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    return path


def test_w8a8_run_records_its_precision_and_replays_bitwise(w8a8_run, tmp_path):
    extra = json.loads((w8a8_run / "manifest.json").read_text())["extra"]
    assert extra["rollout_precision"] == "fp8_w8a8"
    out = CliRunner().invoke(debug_app, ["summary", str(w8a8_run), "--json"])
    assert json.loads(out.output)["rollout_precision"] == {"weight_dtype": "fp8", "kv_dtype": "auto",
                                                           "precision": "fp8_w8a8"}
    assert "activations fp8 (W8A8)" in CliRunner().invoke(debug_app, ["summary", str(w8a8_run)]).output
    result = replay_rollout(w8a8_run, 1)
    assert result.verdict == "bitwise-equal", result.first_divergence
    tf = teacher_forced_check(w8a8_run, 1, top=3)  # replay --rollout --engine embedded: the same W8A8 path
    assert tf.tokens > 0 and tf.summary["max_abs_embedded_vs_recorded"] == 0.0
    # the activations are what makes it bitwise: replayed with fp8 weights only, the step diverges
    copy = tmp_path / "weights_only"
    shutil.copytree(w8a8_run, copy)
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["rollout"].update(precision="auto", weight_dtype="fp8")
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert replay_rollout(copy, 1).verdict == "diverged"
