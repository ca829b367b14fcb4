"""`rollout.exact: true` on CUDA (run by scripts/gpu-check-exact.sh on a lent GPU machine): is the
exact op set bitwise on the GPU, and what does it cost there?

For fp32 and bf16 (the model's dtype, as `model.dtype: bfloat16` sets it), on the GPU: the exact
embedded engine samples the requests of bench/exact_mode.py (prompts sharing a prefix, temperature
0.7, EOS ignored), the exact torch trainer scores the same tokens, and the normal engine/trainer pair
does the same for scale. Printed per dtype as one JSON line: max |Δ| and bitwise-equal token count
of each pair, routing agreement, the rollout tokens/s ratio (exact / normal) and the train-step
ratio, best of `--repeats` interleaved wall-clock timings (CUDA synchronised). The exact op set's GEMM
row threshold is measured on the CPU (axrl/model/exact.py): whether cuBLAS keeps a row's result
independent of the row count is exactly what the bitwise check finds out here.

Exits 2 with a clear message without a CUDA device; 1 when a pair is not bitwise in some dtype.

    python scripts/gpu_check_exact.py [--repeats 3] [--prompts 8] [--group 8] [--new-tokens 40] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synced(fn):
    """`fn` followed by a CUDA synchronise (so a wall-clock timing covers the device's work)."""
    def run():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return run


def check_dtype(name: str, args: argparse.Namespace) -> dict:
    """One dtype: bitwise check and cost of the exact pair on CUDA, the normal pair beside it."""
    from engine_throughput import best_times
    from exact_mode import delta, packed, requests

    from axrl.algo import PolicyLossConfig, make_policy_loss
    from axrl.inference import EmbeddedEngine
    from axrl.model import build_model, preset_config
    from axrl.model.exact import set_exact
    from axrl.train import TorchBackend, TorchBackendConfig

    dev, dtype = torch.device(args.device), DTYPES[name]
    cfg = preset_config(args.preset)
    reqs = requests(args.prompts, args.group, args.new_tokens, cfg.vocab_size)

    def model(exact: bool):
        return set_exact(build_model(cfg, seed=0).to(device=dev, dtype=dtype), exact)

    n = len(reqs)
    engines = {k: EmbeddedEngine(model(k == "exact").eval(), max_batch_size=n, max_seq_len=256, seed=3)
               for k in ("normal", "exact")}
    try:
        outs = {k: e.generate_batch(reqs, timeout=600) for k, e in engines.items()}
        roll = best_times([synced(lambda e=e: e.generate_batch(reqs, timeout=600)) for e in engines.values()],
                          args.repeats)
    finally:
        for e in engines.values():
            e.shutdown()
    tokens = {k: sum(len(o.output_ids) for o in v) for k, v in outs.items()}
    backends = {k: TorchBackend(model(k == "exact"), TorchBackendConfig(lr=1e-5, micro_batch_tokens=4096,
                                                                       exact=k == "exact"))
                for k in ("normal", "exact")}
    batches = {k: packed(reqs, outs[k]) for k in backends}
    deltas = {k: delta(backends[k], batches[k]) for k in backends}
    loss_fn = make_policy_loss(PolicyLossConfig(tis=True))

    def step(k: str) -> None:
        backends[k].forward(batches[k])
        backends[k].forward_backward(batches[k], loss_fn)
        backends[k].optimizer_step()

    train = best_times([synced(lambda k=k: step(k)) for k in backends], args.repeats)
    tok_s = {k: tokens[k] / t for k, t in zip(engines, roll)}
    return {"check": f"exact_{dev.type}_{name}", "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "dtype": name,
            "exact_max_abs_delta": deltas["exact"][0], "exact_routing_agreement": deltas["exact"][1],
            "normal_max_abs_delta": deltas["normal"][0], "bitwise": deltas["exact"][0] == 0.0,
            "exact_rollout_tok_s_ratio": round(tok_s["exact"] / tok_s["normal"], 4),
            "exact_train_step_ratio": round(train[1] / train[0], 4),
            "rollout_tok_s": {k: round(v, 1) for k, v in tok_s.items()},
            "train_step_s": {"normal": round(train[0], 4), "exact": round(train[1], 4)},
            "generated_tokens": tokens["exact"], "samples": n, "clock": "wall"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (1 thread)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the exact op set's CPU thresholds are per thread count
    elif not torch.cuda.is_available():
        print(f"gpu_check_exact: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "run this on a GPU machine with a CUDA build of torch", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    ok = True
    for name in args.dtypes.split(","):
        t0 = time.perf_counter()
        row = check_dtype(name, args)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        ok &= row["bitwise"]
        print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
