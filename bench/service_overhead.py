"""What the Tinker-compatible service costs: one training step (forward_backward + optim_step)
through the official `tinker` SDK against `axrl serve --training`, vs the same update in process.

Both sides train the same LoRA model (a random-init preset with AxRL's tokenizer, rank `--rank`)
on the same `--datums` cross-entropy datums of `--tokens` tokens, with the same AdamW parameters,
one torch thread each. In process: `axrl.tinker_api.training.run_call` + `apply_optim` on a backend
built by `make_train_backend` from the same config the server builds — the server's own compute.
Through the SDK: protobuf encoding, HTTP, seq_id ordering, the future's long-poll, the per-datum
logprobs back, and the server recording the step (trace file in the background, metrics line,
weight fingerprint). Steps alternate (SDK, in process, SDK, …) so both see the same machine load;
the medians are compared.

    OMP_NUM_THREADS=1 python bench/service_overhead.py --steps 8

Last stdout line: one JSON object; `service_vs_inprocess_step_time` (SDK step / in-process step,
medians; the issue's target ≤ 1.1), `service_vs_inprocess_paired_ratio` (median of each pair's
ratio), and the two medians in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from axrl.assembly.build import make_tokenizer, make_train_backend
from axrl.config import load_config
from axrl.inference.sglang.launcher import free_port
from axrl.model import build_model, preset_config, save_hf
from axrl.assembly.tinker_api import model_config
from axrl.tinker_api.batch import pack
from axrl.tinker_api.training import apply_optim, check_adam, run_call
from axrl.tinker_api.wire import Datum
from axrl.tokenizer import Tokenizer

ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def _server(model: Path, run: Path, log: Path, *extra: str, wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`axrl serve --training` on `model` with the flags `extra`, once it answers (within `wait_s`)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "axrl.cli", "serve", "--model-path", str(model), "--training",
                             "--run-dir", str(run), "--port", str(port), *extra], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(int(wait_s * 2)):
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"axrl serve --training did not start: {log.read_text()[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="axrl-service-bench-"))
    tok = Tokenizer.default()
    mcfg = preset_config(args.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model_dir = save_hf(build_model(mcfg, seed=0), tmp / "model", tokenizer=tok)
    g = np.random.default_rng(0)
    seqs = [g.integers(3, tok.vocab_size, args.tokens + 1).tolist() for _ in range(args.datums)]
    weights = np.ones(args.tokens, np.float32)

    cfg = model_config(load_config(None), model_dir, args.rank)
    backend = make_train_backend(cfg, make_tokenizer(cfg))
    batch = pack([Datum(np.asarray(s, np.int64), {"weights": weights}) for s in seqs], "cross_entropy")
    adam = check_adam(ADAM)

    proc, url = _server(model_dir, tmp / "run", tmp / "server.log")
    try:
        tc = tinker.ServiceClient(base_url=url, api_key="tml-bench").create_lora_training_client(
            base_model=str(model_dir), rank=args.rank).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": np.asarray(s[1:]), "weights": weights}) for s in seqs]
        sdk_params = types.AdamParams(**ADAM)
        service, inproc = [], []
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(sdk_params).result()
            fb.result()
            t1 = time.perf_counter()
            run_call(backend, batch, "cross_entropy", {})
            apply_optim(backend, adam)
            t2 = time.perf_counter()
            if i >= args.warmup:
                service.append(t1 - t0)
                inproc.append(t2 - t1)
            print(f"step {i}: service {t1 - t0:.3f} s, in process {t2 - t1:.3f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    s_med, i_med = statistics.median(service), statistics.median(inproc)
    print(json.dumps({"service_vs_inprocess_step_time": round(s_med / i_med, 4),
                      "service_vs_inprocess_paired_ratio": round(statistics.median(
                          [a / b for a, b in zip(service, inproc)]), 4),
                      "service_step_s": round(s_med, 4), "inprocess_step_s": round(i_med, 4),
                      "preset": args.preset, "datums": args.datums, "tokens": args.tokens, "rank": args.rank,
                      "steps": args.steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
