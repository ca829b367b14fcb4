"""The sync sentinel's first real fault (issue #40 §1): vLLM's in-place MoE reload, stale on the
CPU build (docs/vllm.md), with the restart work-around switched off (`weight_route="reload"`).

One real vLLM server (tiny-moe, float32) on the seed-0 weights, launched as AxRL launches it
(with its worker extension); the sentinel (`sync.verify: both`, the server side of
docs/engines.md) finds the fresh load's checksums clean, every HF tensor either compared or
named unreadable, calibrates its floor on two of the server's own samples, then the weights go to
seed 1 by the in-place reload and the sentinel must flag it: the checksums name every re-packed
expert tensor (layer, expert) and show the cause (the reload left them in the plain layout), the
probe names the tokens; after AxRL's re-packing both are clean. Opt-in like tests/test_vllm_real.py: `-m vllm` with AXRL_VLLM_PYTHON.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import build_model, hf_state_dict, preset_config, save_hf
from axrl.sync.checksums import tensor_checksum
from axrl.sync.engine_side import ServerSide
from axrl.sync.settings import SyncSettings
from axrl.sync.verify import SyncSentinel
from axrl.tokenizer import Tokenizer
from test_vllm_real import SKIP_REASON, VLLM_PYTHON


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)
def test_the_sentinel_catches_the_stale_in_place_moe_reload(tmp_path: Path) -> None:
    from axrl.inference.vllm.checksums import vllm_checksum_pair

    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    models = [build_model(cfg, seed=s) for s in (0, 1)]
    start_dir = save_hf(models[0], tmp_path / "seed0", tokenizer=tok)
    events: list[dict[str, Any]] = []
    with _server(start_dir, tmp_path) as (launcher, engine):
        side = ServerSide(engine, "vllm", tok.vocab_size, vllm_checksum_pair)
        sentinel = SyncSentinel(SyncSettings(verify="both"), side, cfg,
                                record=lambda event, **f: events.append({"event": event, **f}))
        reload = lambda: None  # noqa: E731 — a resync is not what this test is about
        assert sentinel.verify(hf_state_dict(models[0]), 0, reason="start", resend=reload) == []
        (partial,) = [e for e in events if e["event"] == "sync_checksum_partial"]
        pair = vllm_checksum_pair(engine, 0, hf_state_dict(models[0]))
        _assert_coverage(pair, hf_state_dict(models[0]))
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
        t1 = time.perf_counter()
        after = vllm_checksum_pair(engine, 0, hf_state_dict(models[1]))
        checksum_s = time.perf_counter() - t1
        # AxRL's repair (the reload route's `repack_experts`, on by default for launched CPU servers)
        repacked = engine.worker_call(0, "axrl_repack_experts", str(engine.weights_dir.resolve()))["results"][0]
        assert json.loads(repacked) == {"repacked": cfg.num_hidden_layers, "already_packed": 0, "neither": 0}
        again = engine.worker_call(0, "axrl_repack_experts", str(engine.weights_dir.resolve()))["results"][0]
        assert json.loads(again)["already_packed"] == cfg.num_hidden_layers   # never packed twice
        assert sentinel.verify(hf_state_dict(models[1]), 1, reason="sync", resend=reload) == []
    by_check = {f["check"]: f for f in findings}
    probe = by_check["probe"]
    assert probe["logprob_max_abs"] > probe["floor"]["limit_logprob"]
    mismatch = [e for e in events if e["event"] == "sync_mismatch"]
    assert {e["check"] for e in mismatch} == set(by_check) and all(e["step"] == 1 for e in mismatch)
    assert probe["tokens"] and {"probe", "position", "token", "delta"} <= set(probe["tokens"][0])
    # the checksums name every re-packed expert tensor of every layer: the reload wrote the new
    # weights in vLLM's plain stacked layout and never re-packed them for the CPU kernel
    checksum = by_check["checksum"]
    n_layers, n_experts = cfg.num_hidden_layers, cfg.num_experts
    assert checksum["count"] == 2 * n_layers * n_experts and checksum["layers"] == list(range(n_layers))
    assert len(checksum["experts"]) == n_layers * n_experts
    new = hf_state_dict(models[1])
    plain = torch.cat([new[f"model.layers.0.mlp.experts.0.{x}_proj.weight"] for x in ("gate", "up")])
    assert after.held["model.layers.0.mlp.experts.0.gate_up_proj.weight"].digest == tensor_checksum(plain).digest
    print(f"[sentinel-vllm] floor {floor.logprob_max_abs:.3g}, after the in-place reload "
          f"{probe['logprob_max_abs']:.3g}; reload + verification {took:.2f} s; one checksum pair {checksum_s:.3f} s; "
          f"unreadable {partial['count']}; "
          f"checksum finding: {checksum['count']} tensors, first {checksum['tensors'][0]['tensor']}")


def _assert_coverage(pair, weights) -> None:
    """Every HF tensor is either compared or named unreadable; a fresh load compares clean."""
    from axrl.sync.checksums import compare_checksums

    assert compare_checksums(pair.expected, pair.held) == []
    covered = set(pair.held) | set(pair.unreadable)
    covered |= {k.replace(".gate_up_proj.", ".gate_proj.") for k in pair.held} | \
        {k.replace(".gate_up_proj.", ".up_proj.") for k in pair.held}
    assert set(weights) - covered <= {"lm_head.weight"}, sorted(set(weights) - covered)[:8]


@contextlib.contextmanager
def _server(start_dir: Path, tmp_path: Path):
    from axrl.inference.remote.launcher import ServerLauncher, free_port
    from axrl.inference.sglang.settings import ServedModel
    from axrl.inference.vllm.client import VLLMEngine
    from axrl.inference.vllm.factory import SERVER_MODULE, server_args, server_env
    from axrl.inference.vllm.settings import VLLMSettings

    launcher = ServerLauncher(start_dir, command=[VLLM_PYTHON, "-m", SERVER_MODULE],
                              server_args=server_args(VLLMSettings(), ServedModel(max_context_len=512), prefix_cache=True),
                              model_flag="--model", base_port=free_port(), startup_timeout_s=600,
                              log_dir=tmp_path / "logs", env=server_env(VLLMSettings(), threads=1))
    launcher.start()
    with VLLMEngine(launcher.urls, launcher=launcher, weight_route="reload", model_dir=start_dir,
                    vocab_size=Tokenizer.default().vocab_size, timeout_s=300) as engine:
        yield launcher, engine
