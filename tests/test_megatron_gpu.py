"""The Megatron backend on CUDA (skipped without a GPU): the CPU suite's parity and R3 checks in
fp32 and bf16, and a short `axrl train` run. Run on a GPU machine with
`scripts/gpu-check-megatron.sh`, which also records the measured differences."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axrl.model import build_model, preset_config
from axrl.train import TorchBackend, TorchBackendConfig
from tests.backend_util import make_batch
from tests.test_train_backend import pg_loss

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (scripts/gpu-check-megatron.sh)", allow_module_level=True)
import megatron.core  # noqa: E402,F401  (the test extra installs it: a broken import fails)

from axrl.train.megatron import MegatronBackend, MegatronBackendConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REPORT = os.environ.get("AXRL_GPU_REPORT")  # JSON lines of measured figures, when set


def record(**figures) -> None:
    print(json.dumps(figures))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(figures) + "\n")


@pytest.fixture(scope="module")
def backends():
    """One torch backend on CUDA and one Megatron backend (world size 1, NCCL), same weights."""
    cfg = preset_config("tiny-moe")
    tb = TorchBackend(build_model(cfg, seed=3).cuda(), TorchBackendConfig(lr=1e-3, num_threads=1))
    mb = MegatronBackend(build_model(cfg, seed=3), MegatronBackendConfig(lr=1e-3, num_threads=1))
    yield tb, mb
    mb.close()


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 0.25)])
def test_cuda_logprob_parity(backends, dtype, tol):
    tb, mb = backends
    tb.config = tb.config.model_copy(update={"dtype": dtype})
    mb.config = mb.config.model_copy(update={"dtype": dtype})
    batch = make_batch(lengths=[40, 64, 17, 90], temperature=0.7)
    a, b = tb.forward(batch), mb.forward(batch)
    diff = (a.logprobs - b.logprobs).abs()
    agree = float((a.routed_experts == b.routed_experts).float().mean())
    record(check=f"logprob_parity_{dtype}", max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
           routing_agreement=agree)
    assert float(diff.max()) < tol
    if dtype == "float32":
        assert agree == 1.0


def test_cuda_update_parity_fp32(backends):
    tb, mb = backends
    mb.load_state_dict(tb.state_dict())
    for b in (tb, mb):
        b.config = b.config.model_copy(update={"dtype": "float32"})
    batch = make_batch(lengths=[40, 64, 17, 90])
    m1, m2 = tb.forward_backward(batch, pg_loss), mb.forward_backward(batch, pg_loss)
    s1, s2 = tb.optimizer_step(), mb.optimizer_step()
    record(check="update_parity_fp32", loss_diff=abs(m1.loss - m2.loss), grad_norm_diff=abs(s1.grad_norm - s2.grad_norm),
           grad_norm=s1.grad_norm)
    assert abs(m1.loss - m2.loss) < 1e-5 and abs(s1.grad_norm - s2.grad_norm) < 1e-5 * max(1.0, s1.grad_norm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_r3(dtype):
    cfg = preset_config("micro-moe")
    mb = MegatronBackend(build_model(cfg, seed=5), MegatronBackendConfig(lr=0.3, weight_decay=0.0, dtype=dtype))
    try:
        batch = make_batch(lengths=[20, 25, 18, 30])
        recorded = mb.forward(batch).routed_experts
        for _ in range(4):
            mb.forward_backward(batch, pg_loss)
            mb.optimizer_step()
        drifted = mb.forward(batch)
        replay = dataclasses.replace(batch, routed_experts=recorded)
        replayed = mb.forward(replay, r3=True)
        ref = TorchBackend(mb.hf_model().cuda(), TorchBackendConfig(num_threads=1, dtype=dtype)).forward(replay, r3=True)
        record(check=f"r3_{dtype}", drifted_agreement=float((drifted.routed_experts == recorded).float().mean()),
               replayed_vs_forced_embedded_max_diff=float((replayed.logprobs - ref.logprobs).abs().max()))
        assert torch.equal(replayed.routed_experts, recorded)
        assert float((drifted.routed_experts == recorded).float().mean()) < 0.99
        if dtype == "float32":
            assert torch.allclose(replayed.logprobs, ref.logprobs, rtol=1e-6, atol=1e-5)
        gate = "model.layers.0.mlp.gate.weight"
        before = dict(mb.named_weights())[gate].clone()
        mb.forward_backward(replay, pg_loss, r3=True)
        mb.optimizer_step()
        assert not torch.equal(before, dict(mb.named_weights())[gate])
    finally:
        mb.close()


def test_cuda_partial_r3_and_per_tensor_norms(backends):
    """Partial R3 (the per-router get_replay_topk replacement on device tensors) and the per-HF-
    tensor gradient norms, against the embedded backend on CUDA (fp32)."""
    from axrl.train.protocol import R3Scope
    from tests.test_train_backend import random_routing

    tb, mb = backends
    mb.load_state_dict(tb.state_dict())
    for b in (tb, mb):
        b.config = b.config.model_copy(update={"dtype": "float32"})
    batch = make_batch(lengths=[40, 64, 17, 90])
    cfg = tb.model.config
    forced = random_routing(batch.num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
    rb = dataclasses.replace(batch, routed_experts=forced)
    for scope in (R3Scope(loss_tokens_only=True), R3Scope(exclude_layers=(0,))):
        a, b = tb.forward(rb, r3=scope), mb.forward(rb, r3=scope)
        diff = float((a.logprobs - b.logprobs).abs().max())
        record(check=f"partial_r3_{'loss_tokens' if scope.loss_tokens_only else 'exclude_0'}", max_abs_diff=diff,
               routing_equal=bool(torch.equal(a.routed_experts, b.routed_experts)))
        assert torch.equal(a.routed_experts, b.routed_experts) and diff < 1e-5
    tb.forward_backward(batch, pg_loss), mb.forward_backward(batch, pg_loss)
    s1, s2 = tb.optimizer_step(), mb.optimizer_step()
    worst = max(abs(s2.param_grad_norm[n] - v) / max(1.0, v) for n, v in s1.param_grad_norm.items())
    record(check="param_grad_norm_fp32", max_rel_diff=worst, tensors=len(s1.param_grad_norm))
    assert list(s1.param_grad_norm) == list(s2.param_grad_norm) and worst < 1e-5


def test_cuda_short_training_run(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart.yaml", "--run-dir", str(run),
           "--set", "train.backend=megatron", "--set", "steps=3", "--set", "warmup.steps=30", "--set", "eval.every=0"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    record(check="short_training_run", steps=len(rows), rewards=[r["reward"] for r in rows],
           grad_norms=[r["grad_norm"] for r in rows], mismatch=[r["mismatch"] for r in rows])
    assert len(rows) == 3
