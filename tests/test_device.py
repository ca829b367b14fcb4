"""`runtime.device` and `model.dtype`: where and in what precision the torch trainer and the embedded
engine hold the model. On this CPU machine: the default, a bf16 run, and the refusal of a CUDA
device this torch cannot see; the GPU variant is tests/test_device_gpu.py (scripts/gpu-check-device.sh)."""

from __future__ import annotations

import pytest
import torch

from axrl.config import ConfigError, load_config
from axrl.assembly.build import build_components
from train_util import QUICKSTART, train

SMALL = ["model.preset=micro-moe", "warmup.steps=0", "eval.every=0", "data.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=4", "runtime.threads=1"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtype_is_honoured_by_trainer_and_engine(dtype):
    cfg = load_config(QUICKSTART, [*SMALL, f"model.dtype={dtype}"])
    c = build_components(cfg)
    try:
        want = getattr(torch, dtype)
        trainer = {p.dtype for p in c.backend.model.parameters()}        # type: ignore[attr-defined]
        engine = {p.dtype for p in c.engine.model.parameters()}          # type: ignore[attr-defined]
        assert trainer == engine == {want}
        assert {p.device.type for p in c.engine.model.parameters()} == {"cpu"}  # type: ignore[attr-defined]
        assert c.engine.model is not c.backend.model                     # type: ignore[attr-defined]
    finally:
        c.close()


def test_device_setting_is_validated(tmp_path):
    for bad in ("gpu", "cuda:x", "cpu:0"):
        with pytest.raises(ConfigError, match="runtime.device"):
            load_config(None, [f"runtime.device={bad}"])
    with pytest.raises(ConfigError, match="megatron places its ranks itself"):
        load_config(None, ["runtime.device=cuda", "train.backend=megatron"])
    if not torch.cuda.is_available():
        result = train(tmp_path / "run", [*SMALL, "runtime.device=cuda"], check=False)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "runtime.device 'cuda'" in text and "sees no CUDA device" in text
