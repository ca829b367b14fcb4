"""`runtime.device: cuda` (skipped without a GPU): the torch trainer and the embedded engine hold
the model on the GPU in the configured dtype, a short run trains and its steps replay bit for bit
on the same device. Run on a GPU machine with `scripts/gpu-check-device.sh`, which also runs the
whole quickstart on the GPU and records the figures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (scripts/gpu-check-device.sh)", allow_module_level=True)

from axrl.config import load_config  # noqa: E402
from axrl.assembly.build import build_components  # noqa: E402
from train_util import debug, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPORT = os.environ.get("AXRL_GPU_REPORT")
SMALL = ["model.preset=micro-moe", "warmup.steps=100", "data.task=echo", "data.task_args={}", "eval.every=0",
         "data.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8", "checkpoint.every=2",
         "runtime.device=cuda", "steps=3"]


def record(**figures) -> None:
    print(json.dumps(figures))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(figures) + "\n")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_and_engine_on_the_gpu(dtype):
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", [*SMALL, f"model.dtype={dtype}"])
    c = build_components(cfg)
    try:
        for model in (c.backend.model, c.engine.model):                    # type: ignore[attr-defined]
            assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", getattr(torch, dtype))}
    finally:
        c.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_run_trains_and_replays_bitwise_on_the_gpu(dtype, tmp_path):
    run = tmp_path / "run"
    train(run, [*SMALL, f"model.dtype={dtype}"])
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    result = debug("replay", run, "--step", 2, "--json")
    doc = json.loads(result.stdout)
    record(check=f"device_run_{dtype}", device=torch.cuda.get_device_name(0), verdict=doc["verdict"],
           mismatch=[m["mismatch"] for m in metrics], grad_norm=[m["grad_norm"] for m in metrics],
           step_seconds=[m["step_time"] for m in metrics])
    assert result.exit_code == 0 and doc["verdict"] == "bitwise-equal", result.output


@pytest.mark.parametrize("mode,extra", [
    ("critic", ["algo.advantage=gae", "critic.lr=3e-4", "critic.warmup_steps=1"]),
    ("lora", ["train.lora.rank=8"]),
    ("fp8", ["rollout.weight_dtype=fp8", "rollout.kv_dtype=fp8"]),
])
def test_wave3_modes_train_and_replay_bitwise_on_the_gpu(mode, extra, tmp_path):
    """The critic (its value model and updates on the GPU), LoRA adapters and fp8 rollout: a short
    run trains on the GPU and its last step replays bit for bit there."""
    run = tmp_path / "run"
    train(run, [*SMALL, *extra])
    result = debug("replay", run, "--step", 2, "--json")
    doc = json.loads(result.stdout)
    record(check=f"device_{mode}", device=torch.cuda.get_device_name(0), verdict=doc["verdict"])
    assert result.exit_code == 0 and doc["verdict"] == "bitwise-equal", result.output
