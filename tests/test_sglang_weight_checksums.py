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
    held_checksums, not_compared, sglang_cuda_hash, sglang_hash
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
    # a key SGLang's loader skips (a checkpoint's rotary inv_freq) makes no tensor to compare
    assert expected_checksums(dict(sd, **{p + "self_attn.rotary_emb.inv_freq": torch.ones(4)}), torch.float32) == want


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


def test_cuda_hash_gives_the_values_sglangs_kernel_gave():
    # pinned from SGLang's gpu_tensor_hash kernels under TRITON_INTERPRET=1 (sglang_gpu_hash_check.py);
    # 9000 words span two tiles, 3 bytes pad one word
    assert sglang_cuda_hash(torch.arange(9000, dtype=torch.float32)) == "65fb8c37f0117120"
    assert sglang_cuda_hash(torch.arange(3, dtype=torch.uint8)) == "0a97cf45c78490e5"
    sd = _micro()
    on_cuda = expected_checksums(sd, torch.float32, server_device="cuda")
    assert on_cuda["model.norm.weight"].digest == sglang_cuda_hash(sd["model.norm.weight"])
    assert on_cuda["model.norm.weight"].digest != expected_checksums(sd, torch.float32)["model.norm.weight"].digest
    with pytest.raises(ValueError, match="server_device='npu'"):
        expected_checksums(sd, torch.float32, server_device="npu")


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


def _fake_server(replies: list[tuple[int, dict]]):
    """A local HTTP server answering each POST with the next (status, JSON body) of `replies`."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, body = replies.pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_held_checksums_reads_sglangs_answer_and_says_why_it_has_none():
    def rank(tp: int, sums: dict) -> dict:
        info = dict(role="target", tp_rank=0, tp_size=tp, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
        return {"checksums": sums, "per_gpu_checksum": "x", "parallelism_info": [info]}

    ok = {"success": True, "message": "Success.", "ranks": [rank(1, {"a": "01", "b": "02"}), rank(1, {"a": "01", "b": "03"})]}
    replies = [(200, ok), (404, {"detail": "Not Found"}), (400, {"success": False, "message": "boom"}),
               (200, {"success": True, "message": "", "ranks": [rank(2, {"a": "01"})]})]
    server, url = _fake_server(replies)
    try:
        # dp replicas merged; a name two ranks hash differently matches nothing
        assert held_checksums(url) == {"a": "01", "b": "02|03"}
        with pytest.raises(RuntimeError, match="no /weights_checker route"):
            held_checksums(url)
        with pytest.raises(RuntimeError, match=r"/weights_checker: HTTP 400, SGLang said: 'boom'"):
            held_checksums(url)
        with pytest.raises(RuntimeError, match="tensor-parallel server"):
            held_checksums(url)
    finally:
        server.shutdown()


# -- against a real SGLang server -----------------------------------------------------------------
def real_sglang(fn):
    """`-m sglang` selects it; skipped without AXRL_SGLANG_PYTHON."""
    return pytest.mark.sglang(pytest.mark.skipif(not SGLANG_PYTHON, reason=SKIP_REASON)(fn))


def _report(key: str, value: object) -> None:
    print(f"[sglang-checksums] {key}: {value}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, the checkpoint's HF state dict, its directory) of one SGLang server (cpu_compat,
    float32) on a tiny-moe checkpoint written as `axrl model init --preset tiny-moe` writes it."""
    from axrl.inference.sglang.launcher import SGLangLauncher, free_port
    from axrl.model import load_hf, save_hf
    from axrl.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("sglang-checksums")
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model_dir = save_hf(build_model(cfg, seed=0), root / "model", tokenizer=tok)
    launcher = SGLangLauncher(model_dir, command=[SGLANG_PYTHON, str(CPU_COMPAT)],
                              server_args=["--dtype", "float32", "--random-seed", "0"], base_port=free_port(),
                              env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                              startup_timeout_s=300, log_dir=root / "logs")
    launcher.start()
    try:
        yield launcher.urls[0], hf_state_dict(load_hf(model_dir)), model_dir
    finally:
        launcher.stop()


@real_sglang
def test_fresh_server_holds_the_trainers_tensors(served):
    import httpx

    url, sd, _ = served
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert (info["dtype"], info["device"]) == ("float32", "cpu")
    held = held_checksums(url)
    want = expected_checksums(sd, torch.float32)
    mismatches, compared = compare(want, held)
    assert mismatches == [], [m.to_json() for m in mismatches]
    # every HF tensor of the checkpoint is in some compared SGLang tensor
    covered = {k for name in compared for k in want[name].sources}
    assert covered == set(sd), sorted(set(sd) - covered)
    assert set(compared) <= set(held)
    # the bytes SGLang holds are float32: the same tensors cast to float16 / bfloat16 match nowhere
    for dtype in (torch.float16, torch.bfloat16):
        assert len(compare(expected_checksums(sd, dtype), held)[0]) == len(compared)
    _report("compared", f"{len(compared)} SGLang tensors from {len(sd)} HF tensors; "
                        f"not compared: {not_compared(want, held)}")
    _report("sglang_checksum_s (median of 5)", round(_median_s(lambda: held_checksums(url), 5), 4))
    _report("expected_checksum_s (median of 5)", round(_median_s(lambda: expected_checksums(sd, torch.float32), 5), 4))


@real_sglang
def test_reload_with_one_expert_scaled_names_that_layers_w2(served, tmp_path):
    import httpx
    from safetensors.torch import load_file, save_file

    url, sd, model_dir = served
    layer, expert = PERTURBED
    key = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (changed / f.name).write_bytes(f.read_bytes())
    (weights_file,) = model_dir.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    tensors[key] = tensors[key] * 1.05
    save_file(tensors, str(changed / weights_file.name), metadata={"format": "pt"})
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(changed)}, timeout=300)
    assert r.status_code == 200 and r.json().get("success"), r.text
    held = held_checksums(url)
    mismatches, compared = compare(expected_checksums(sd, torch.float32), held)
    assert [(m.name, m.layer) for m in mismatches] == [(f"model.layers.{layer}.mlp.experts.w2_weight", layer)]
    assert key in mismatches[0].sources and mismatches[0].experts == tuple(range(8))
    assert len(compared) > 1
    # and the changed weights, as the trainer would now post them, match again
    assert compare(expected_checksums(tensors, torch.float32), held)[0] == []
    # the sync sentinel's view of the same server (axrl/sync/engine_side.py ServerSide)
    from types import SimpleNamespace

    from axrl.inference.sglang.checksums import sglang_checksum_pair
    from axrl.sync.checksums import compare_checksums

    pair = sglang_checksum_pair(SimpleNamespace(urls=[url]), 0, sd)
    bad = compare_checksums(pair.expected, pair.held)
    assert [(m.name, m.layer, m.expert) for m in bad] == [(f"model.layers.{layer}.mlp.experts.w2_weight", layer, None)]
    assert bad[0].to_json()["held_sample_sum"] is None and not pair.unreadable
    assert compare_checksums(*(lambda q: (q.expected, q.held))(sglang_checksum_pair(SimpleNamespace(urls=[url]), 0,
                                                                                   tensors))) == []


@real_sglang
def test_cuda_hash_recomputation_matches_sglangs_triton_kernel():
    """`sglang_cuda_hash` against SGLang's own kernels, run by Triton's interpreter on the CPU."""
    import json
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([SGLANG_PYTHON, str(Path(__file__).with_name("sglang_gpu_hash_check.py"))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"checked": 5, "differ": []}, result


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
