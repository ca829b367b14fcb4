"""The sync sentinel's first real fault (issue #40 §1): vLLM's in-place MoE reload, stale on the
CPU build (docs/vllm.md), with the restart work-around switched off (`weight_route="reload"`).

One real vLLM server (tiny-moe, float32) on the seed-0 weights; the sentinel (`sync.verify:
probe`, the server side of docs/engines.md) calibrates its floor on two of the server's own
samples, then the weights go to seed 1 by the in-place reload and the sentinel must flag it,
naming the probe tokens. Opt-in like tests/test_vllm_real.py: `-m vllm` with AXRL_VLLM_PYTHON.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import build_model, hf_state_dict, preset_config, save_hf
from axrl.sync.engine_side import ServerSide
from axrl.sync.settings import SyncSettings
from axrl.sync.verify import SyncSentinel
from axrl.tokenizer import Tokenizer
from test_vllm_real import SKIP_REASON, VLLM_PYTHON


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)
def test_the_sentinel_catches_the_stale_in_place_moe_reload(tmp_path: Path) -> None:
    from axrl.inference.remote.launcher import ServerLauncher, free_port
    from axrl.inference.sglang.settings import ServedModel
    from axrl.inference.vllm.client import VLLMEngine
    from axrl.inference.vllm.factory import SERVER_MODULE, server_args, server_env
    from axrl.inference.vllm.settings import VLLMSettings

    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    models = [build_model(cfg, seed=s) for s in (0, 1)]
    start_dir = save_hf(models[0], tmp_path / "seed0", tokenizer=tok)
    launcher = ServerLauncher(start_dir, command=[VLLM_PYTHON, "-m", SERVER_MODULE],
                              server_args=server_args(VLLMSettings(), ServedModel(max_context_len=512), prefix_cache=True),
                              model_flag="--model", base_port=free_port(), startup_timeout_s=600,
                              log_dir=tmp_path / "logs", env=server_env(VLLMSettings(), threads=1))
    launcher.start()
    events: list[dict[str, Any]] = []
    with VLLMEngine(launcher.urls, launcher=launcher, weight_route="reload", model_dir=start_dir,
                    vocab_size=tok.vocab_size, timeout_s=300) as engine:
        sentinel = SyncSentinel(SyncSettings(verify="probe"), ServerSide(engine, "vllm", tok.vocab_size), cfg,
                                record=lambda event, **f: events.append({"event": event, **f}))
        reload = lambda: None  # noqa: E731 — a resync is not what this test is about
        assert sentinel.verify(hf_state_dict(models[0]), 0, reason="start", resend=reload) == []
        rng = np.random.default_rng(0)
        for k in range(2):   # the run's own samples: what the server generated from two prompts
            prompt = rng.integers(3, tok.vocab_size, size=24).tolist()
            res = engine.generate_batch([GenerateRequest(input_ids=prompt, sampling_params=SamplingParams(
                max_new_tokens=24, temperature=1.0, seed=k, ignore_eos=True))], timeout=300)[0]
            sentinel.observe(np.array(prompt + res.output_ids))
        floor = sentinel.floor
        assert floor is not None and floor.logprob_max_abs < 1e-4   # a fresh load matches the trainer
        t0 = time.perf_counter()
        assert engine.update_weights(dict(hf_state_dict(models[1])), version=1) == 1   # in place, no restart
        findings = sentinel.verify(hf_state_dict(models[1]), 1, reason="sync", resend=reload)
        took = time.perf_counter() - t0
    (finding,) = findings
    assert finding["check"] == "probe" and finding["logprob_max_abs"] > finding["floor"]["limit_logprob"]
    (event,) = events
    assert event["event"] == "sync_mismatch" and event["step"] == 1 and event["engine"] == "vllm"
    assert event["tokens"] and {"probe", "position", "token", "delta"} <= set(event["tokens"][0])
    print(f"[sentinel-vllm] floor {floor.logprob_max_abs:.3g}, after the in-place reload "
          f"{finding['logprob_max_abs']:.3g}; reload + verification {took:.2f} s")
