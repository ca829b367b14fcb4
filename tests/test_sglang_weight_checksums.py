"""Per-tensor weight checksums in SGLang's layout (axrl/inference/sglang/weight_checksums.py).

The layout table is checked without a server on a micro state dict, against tensors built by
hand. The tests marked `sglang` run against ONE real SGLang server (cpu_compat, tiny-moe, fp32) for
the whole module, skipped without AXRL_SGLANG_PYTHON (see tests/test_sglang_real.py):
(a) the fresh server holds exactly the trainer's tensors, every HF key covered;
(b) after an in-place reload with one expert of layer 1 scaled, only layer 1's `w2_weight` differs.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from axrl.inference.sglang.weight_checksums import LAYOUT, ExpectedTensor, compare, expected_checksums, \
    held_checksums, not_compared, sglang_hash
from axrl.model import build_model, hf_state_dict, preset_config

SGLANG_PYTHON = os.environ.get("AXRL_SGLANG_PYTHON", "")
SKIP_REASON = "real-SGLang suite: set AXRL_SGLANG_PYTHON (scripts/sglang-cpu-env.sh)"
CPU_COMPAT = Path(__file__).resolve().parents[1] / "axrl" / "inference" / "sglang" / "cpu_compat.py"
PERTURBED = (1, 3)      # (layer, expert) whose down_proj is scaled by 1.05 in test (b)


def _micro(vocab: int = 1024) -> dict[str, torch.Tensor]:
    return hf_state_dict(build_model(preset_config("micro-moe", vocab_size=vocab), seed=0))


# -- the layout table, no server -----------------------------------------------------------------
def test_fused_and_stacked_tensors_are_built_as_sglang_lays_them_out():
    sd = _micro()
    want = expected_checksums(sd, torch.float32)
    p = "model.layers.1."
    qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert want[p + "self_attn.qkv_proj.weight"].digest == sglang_hash(qkv)
    assert want[p + "self_attn.qkv_proj.weight"].digest != sglang_hash(torch.cat([sd[p + f"self_attn.{x}_proj.weight"]
                                                                                 for x in "kqv"]))
    e = range(4)
    w13 = torch.stack([torch.cat([sd[p + f"mlp.experts.{i}.gate_proj.weight"], sd[p + f"mlp.experts.{i}.up_proj.weight"]])
                       for i in e])
    w2 = torch.stack([sd[p + f"mlp.experts.{i}.down_proj.weight"] for i in e])
    assert w13.shape == (4, 64, 32) and w2.shape == (4, 32, 32)
    assert want[p + "mlp.experts.w13_weight"] == ExpectedTensor(
        sglang_hash(w13), tuple(k for i in e for k in (p + f"mlp.experts.{i}.gate_proj.weight",
                                                         p + f"mlp.experts.{i}.up_proj.weight")), 1, (0, 1, 2, 3))
    assert want[p + "mlp.experts.w2_weight"].digest == sglang_hash(w2)
    assert want[p + "self_attn.o_proj.weight"] == ExpectedTensor(sglang_hash(sd[p + "self_attn.o_proj.weight"]),
                                                                 (p + "self_attn.o_proj.weight",), 1, None)
    # every HF key goes into exactly one SGLang tensor
    sources = [k for t in want.values() for k in t.sources]
    assert sorted(sources) == sorted(sd)


def test_hash_dtype_vocab_padding_and_dense_mlp():
    # SGLang's _hash_tensor: first 8 bytes of sha256 of the raw bytes, big-endian, 16 hex digits
    t = torch.arange(6, dtype=torch.float32)
    assert sglang_hash(t) == f"{int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], 'big'):016x}"
    sd = hf_state_dict(build_model(preset_config("micro-moe", vocab_size=1000, num_experts=0, intermediate_size=48),
                                   seed=0))
    bf = expected_checksums(sd, torch.bfloat16)
    emb = sd["model.embed_tokens.weight"]
    padded = torch.cat([emb.to(torch.bfloat16), torch.zeros(24, emb.shape[1], dtype=torch.bfloat16)])
    assert bf["model.embed_tokens.weight"].digest == sglang_hash(padded)          # 1000 rows → 1024
    assert bf["lm_head.weight"].digest == sglang_hash(torch.cat([sd["lm_head.weight"].to(torch.bfloat16),
                                                                 padded[1000:]]))
    gate_up = torch.cat([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]])
    assert bf["model.layers.0.mlp.gate_up_proj.weight"].digest == sglang_hash(gate_up.to(torch.bfloat16))
    f32 = expected_checksums(sd, torch.float32)
    assert f32["model.layers.0.mlp.gate_up_proj.weight"].digest == sglang_hash(gate_up)
    o = "model.layers.0.self_attn.o_proj.weight"
    assert bf[o].digest == sglang_hash(sd[o].to(torch.bfloat16)) != f32[o].digest      # cast first, then hashed


def test_compare_names_the_stack_and_skips_what_it_does_not_model():
    sd = _micro()
    want = expected_checksums(sd, torch.float32)
    held = {n: t.digest for n, t in want.items()} | {"model.layers.0.self_attn.rotary_emb.cos_sin_cache": "00"}
    assert compare(want, held) == ([], list(want))
    assert not_compared(want, held) == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]
    bad = dict(sd)
    bad["model.layers.1.mlp.experts.2.down_proj.weight"] = bad["model.layers.1.mlp.experts.2.down_proj.weight"] * 1.05
    mism, compared = compare(expected_checksums(bad, torch.float32), held)
    assert [(m.name, m.layer, m.experts) for m in mism] == [("model.layers.1.mlp.experts.w2_weight", 1, (0, 1, 2, 3))]
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in mism[0].sources and len(compared) == len(want)
    # a tensor the server does not report: a mismatch, unless the server reported nothing at all
    del held["model.norm.weight"]
    assert [m.name for m in compare(want, held)[0]] == ["model.norm.weight"]
    assert compare(want, {}) == ([], [])
    # tied embeddings: SGLang holds the embedding once; an lm_head equal to it is not missing
    tied = dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"]})
    want_tied = expected_checksums(tied, torch.float32)
    held_tied = {n: t.digest for n, t in want_tied.items() if n != "lm_head.weight"}
    assert compare(want_tied, held_tied)[0] == []


def test_incomplete_state_dict_and_unreachable_server_say_what_is_missing():
    sd = _micro()
    del sd["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj.*no 'k_proj' piece"):
        expected_checksums(sd, torch.float32)
    sd = _micro()
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"], sd["model.layers.1.mlp.experts.2.gate_proj.weight"]
    with pytest.raises(ValueError, match=r"w13_weight.*not \[2\]"):
        expected_checksums(sd, torch.float32)
    from axrl.inference.sglang.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match=rf"{url}/weights_checker: no answer"):
        held_checksums(url, timeout_s=5)
    assert len({r.where for r in LAYOUT}) == len(LAYOUT)     # each rule says where SGLang does it
