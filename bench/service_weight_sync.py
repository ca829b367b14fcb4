"""What new sampler weights cost `axrl serve --training` on each sampling engine: the embedded
engine, a real SGLang server and a real vLLM server (the CPU builds), side by side in one run.

Each engine gets its own service on the same random-init model (`--preset`, float32, one torch
thread). Per round, through the official `tinker` SDK: one training step (forward_backward +
optim_step, `importance_sampling` on the previous round's samples), `save_weights_for_sampler`,
then the same sampling request twice on the new weights. The first request waits for the weight
sync (the engine loads the snapshot before it samples), the second only samples: their difference
is the sync. The service's start-up (its sampling servers included) is timed too.

    OMP_NUM_THREADS=1 python bench/service_weight_sync.py --rounds 2 \\
        --sglang-python ~/.cache/axrl/sglang-venv/bin/python --vllm-python ~/.cache/axrl/vllm-venv/bin/python

An engine whose `--*-python` is not given is left out. Last stdout line: one JSON object with, per
engine, `startup_s`, `weight_sync_s` (median over rounds), `sample_s` (the second request, median)
and `weight_sync_vs_embedded` (its median sync / the embedded engine's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

from axrl.model import build_model, preset_config, save_hf
from axrl.tokenizer import Tokenizer
from service_overhead import _server


def engine_flags(engine: str, python: str | None, logs: Path) -> list[str]:
    """`--set` flags that make the service sample on `engine` (servers launched from `python`)."""
    if engine == "embedded":
        return []
    sets = {"sglang": {"rollout.engine": "sglang", "rollout.sglang.server": "sglang", "rollout.sglang.python": python,
                       "rollout.sglang.cpu_compat": "true", "rollout.sglang.log_dir": str(logs)},
            "vllm": {"rollout.engine": "vllm", "rollout.vllm.python": python, "rollout.vllm.log_dir": str(logs)}}[engine]
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def rl_datum(prompt: list[int], seq: types.SampledSequence) -> types.Datum:
    full, pad = prompt + list(seq.tokens), [0.0] * (len(prompt) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(full[1:]),
                                       "logprobs": np.asarray(pad + list(seq.logprobs), np.float32),
                                       "advantages": np.asarray(pad + [1.0] * len(seq.tokens), np.float32)})


def measure(url: str, model: Path, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    """The rounds of one service (see the module docstring): each round's sync and sample times."""
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    tc = sc.create_lora_training_client(base_model=str(model), rank=4).result()
    prompt = Tokenizer.default().encode("what is two plus three")
    params = types.SamplingParams(max_tokens=max_tokens, seed=0, stop=[])
    sampler = sc.create_sampling_client(base_model=str(model)).result()
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
    out: dict[str, list[float]] = {"weight_sync_s": [], "sample_s": []}
    for r in range(rounds):
        tc.forward_backward([rl_datum(prompt, s) for s in seqs], "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        path = tc.save_weights_for_sampler(f"round{r}").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
            times.append(time.perf_counter() - t0)
        out["weight_sync_s"].append(times[0] - times[1])
        out["sample_s"].append(times[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sglang-python", default=None, help="python of scripts/sglang-cpu-env.sh's environment")
    ap.add_argument("--vllm-python", default=None, help="python of scripts/vllm-cpu-env.sh's environment")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="axrl-service-sync-"))
    tok = Tokenizer.default()
    cfg = preset_config(args.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model = save_hf(build_model(cfg, seed=0), tmp / "model", tokenizer=tok)
    engines = {"embedded": None, "sglang": args.sglang_python, "vllm": args.vllm_python}
    result: dict[str, dict[str, float]] = {}
    for engine, python in engines.items():
        if engine != "embedded" and not python:
            continue
        t0 = time.perf_counter()
        proc, url = _server(model, tmp / f"run-{engine}", tmp / f"{engine}.log", "--full-finetune",
                            *engine_flags(engine, python, tmp / f"{engine}-logs"), wait_s=900)
        startup = time.perf_counter() - t0
        try:
            rounds = measure(url, model, args.rounds, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(120)
        result[engine] = {"startup_s": round(startup, 2),
                          **{k: round(statistics.median(v), 3) for k, v in rounds.items()}}
        print(f"{engine}: {json.dumps(result[engine])} (rounds: {json.dumps(rounds)})", file=sys.stderr, flush=True)
    base = max(result["embedded"]["weight_sync_s"], 1e-3)
    for r in result.values():
        r["weight_sync_vs_embedded"] = round(r["weight_sync_s"] / base, 1)
    print(json.dumps({"preset": args.preset, "rounds": args.rounds, "engines": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
