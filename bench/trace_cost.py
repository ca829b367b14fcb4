"""What a step file costs to write and to read back, per storage layout of the token datasets.

One synthetic step (`analysis_throughput.make_step`: multi-turn samples with a tool segment, MoE
routing [T, 4, 2] uint8 for rollout and trainer, every token field; 2 updates × 4 micro-batches)
is written with `write_step` — validation, HDF5, fsyncs and the rename included — in each layout,
round-robin so that machine noise hits every layout alike. Reported per layout: median write time,
file size, the time to read back (from the page cache) the datasets `axrl-debug mismatch`
reads, per generated token, and `read_step` of the whole file.

    python bench/trace_cost.py                    # T = 20 000 tokens, 30 writes per layout
    python bench/trace_cost.py --tokens 300000 --runs 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {   # name -> write_step keyword arguments
    "default: analysis columns raw, others gzip-1": {},
    "gzip-1 + shuffle, every token dataset": {"raw": frozenset()},
    "lzf + shuffle, every token dataset": {"compression": "lzf", "raw": frozenset()},
    "raw, every token dataset": {"compression": None},
    "contiguous, no checksum": {"compression": None, "checksum": False},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20000, help="tokens in the step (default 20000)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--runs", type=int, default=30, help="writes per layout (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from analysis_throughput import PROMPT_LEN, hdf5_record, make_step

    from axrl.trace import StepFile, read_step, write_step
    from axrl_debug.analysis.mismatch import MismatchConfig

    mean_resp = max(2 * PROMPT_LEN, args.tokens // args.samples - PROMPT_LEN)
    d = make_step(3, args.samples, mean_resp, np.random.default_rng(args.seed))
    rec = dataclasses.replace(hdf5_record(3, d), micro_batch_metrics={
        "update": [0, 0, 0, 0, 1, 1, 1, 1], "loss": np.linspace(0.1, 0.8, 8),
        "num_tokens": np.full(8, int(d["off"][-1]) // 8)})
    tokens, generated = int(d["off"][-1]), int(d["loss_mask"].sum())
    required, optional = MismatchConfig().columns()
    root = Path(tempfile.mkdtemp(prefix="axrl-bench-trace-cost-"))
    writes: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    paths: dict[str, Path] = {}
    try:
        for i in range(args.runs + 1):                       # the first round warms up
            for j, (name, kw) in enumerate(LAYOUTS.items()):
                t0 = time.perf_counter()
                paths[name] = write_step(root / str(j), rec, overwrite=True, **kw)
                if i:
                    writes[name].append(time.perf_counter() - t0)
        reads: dict[str, float] = {}
        whole: dict[str, float] = {}
        for name, path in paths.items():
            buffers: dict = {}
            best = best_all = float("inf")
            for _ in range(max(5, args.runs // 3)):
                t0 = time.perf_counter()
                with StepFile(path) as sf:
                    sf.read_columns(required, optional=optional, buffers=buffers, fast_checksums=True)
                t1 = time.perf_counter()
                read_step(path)
                best, best_all = min(best, t1 - t0), min(best_all, time.perf_counter() - t1)
            reads[name], whole[name] = best, best_all
        rows = [(name, statistics.median(writes[name]), paths[name].stat().st_size, reads[name]) for name in LAYOUTS]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"step file of T = {tokens:,} tokens ({generated:,} generated), N = {args.samples} samples, "
          f"routing [T, 4, 2] x 2; median of {args.runs} writes; read = mismatch's datasets, best of several")
    w = max(len(r[0]) for r in rows)
    print(f"  {'token datasets':<{w}}  {'write':>9}  {'file':>9}  {'read':>9}  {'read/gen. token':>15}  {'read_step':>9}")
    for name, wt, size, rt in rows:
        print(f"  {name:<{w}}  {wt * 1e3:7.1f} ms  {size / 1e3:6.0f} kB  {rt * 1e3:6.2f} ms  "
              f"{rt / generated * 1e9:12.1f} ns  {whole[name] * 1e3:6.2f} ms")
    print(json.dumps({"tokens": tokens, "generated": generated, "layouts": {
        name: {"write_ms": round(wt * 1e3, 2), "bytes": size, "read_ms": round(rt * 1e3, 3),
               "read_ns_per_generated_token": round(rt / generated * 1e9, 1),
               "read_step_ms": round(whole[name] * 1e3, 2)} for name, wt, size, rt in rows}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
