"""The smallest magnitude of each injected fault that `axrl-debug doctor` names as its top finding.

For every fault of tests/fault_zoo.py, small runs (micro-moe, multi-turn echo, 2 steps) are trained
with the fault at decreasing magnitudes; each is diagnosed trace-only (`diagnose(rescore=False,
reexec=False)`, the dtype envelope: the strictest reading without re-execution) and the top cause is
compared with the injected one. A clean control with the same settings is diagnosed first.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/doctor_zoo.py [--faults a,b] [--reexec] [--out DIR]

With --reexec each run is also diagnosed with re-execution (the `doctor` default), column top_reexec.

Prints one row per (fault, magnitude) and ends with one JSON line:
{"doctor_zoo_smallest": {fault: smallest magnitude found or null}, "doctor_zoo_rows": [...],
 "clean_top": cause}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import fault_zoo as fz  # noqa: E402
from axrl_debug.analysis.doctor import diagnose  # noqa: E402

#: fault → (cause, [(magnitude label, injector factory)], largest first)
SWEEPS = {
    "stale_expert": ("stale_tensor", [(m, lambda m=m: fz.stale_expert(1, 2, scale=m)) for m in (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)]),
    "skipped_sync": ("weights_out_of_sync", [(m, lambda m=m: fz.skipped_sync(1, scale=m)) for m in (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)]),
    "prefill_decode": ("prefill_decode", [(m, lambda m=m: fz.prefill_perturbation(m)) for m in (1e-3, 1e-4, 1e-5, 3e-6, 1e-6)]),
    "router_noise": ("routing_flips", [(m, lambda m=m: fz.router_noise(m)) for m in (5e-2, 1e-2, 1e-3, 3e-4, 1e-4)]),
    "context_drift": ("context_mismatch", [(v, lambda v=v: fz.context_drift(v)) for v in
                                           ("generation_prompt_rerendered", "previous_reply_close_rerendered")]),
    "kv_cache": ("kv_cache_precision", [("bf16", lambda: fz.kv_cache_dtype(torch.bfloat16)),
                                        ("fp16", lambda: fz.kv_cache_dtype(torch.float16))]),
    # the run samples at temperature 0.7; the engine reports its logprobs at T (the magnitude)
    "logprob_temperature": ("logprob_semantics", [(t, lambda t=t: fz.logprob_temperature(t))
                                                  for t in (1.0, 0.8, 0.72, 0.705, 0.701)]),
    "unmasked_observations": ("masking", [("all observations", fz.unmasked_observations),
                                          ("1 token a trajectory", lambda: fz.unmasked_observations(1))]),
}


def top_of(run: Path, reexec: bool = False) -> tuple[str, list[int]]:
    report = diagnose(run, rescore=False, reexec=reexec)
    return report["top"], report["flagged_steps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default=",".join(SWEEPS), help="comma-separated subset of " + ", ".join(SWEEPS))
    ap.add_argument("--reexec", action="store_true",
                    help="also diagnose every run with re-execution (the `doctor` default): column top_reexec")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="doctor_zoo_"))
    t0 = time.perf_counter()
    clean = fz.train_run(root / "clean", steps=2)
    clean_top, _ = top_of(clean)
    print(f"clean control: top finding {clean_top}")
    rows, smallest = [], {}
    for fault in args.faults.split(","):
        cause, sweep = SWEEPS[fault]
        smallest[fault] = None
        for label, make in sweep:
            run = root / f"{fault}_{label}".replace(" ", "_")
            shutil.rmtree(run, ignore_errors=True)
            with make():
                fz.train_run(run, steps=2)
            top, flagged = top_of(run)
            found = top == cause
            rows.append({"fault": fault, "magnitude": label, "expected": cause, "top": top, "found": found,
                         "flagged_steps": flagged})
            extra = ""
            if args.reexec:
                rows[-1]["top_reexec"] = top_of(run, reexec=True)[0]
                extra = f"  re-executed: top={rows[-1]['top_reexec']}"
            print(f"{fault:24s} {str(label):>18s}  top={top:20s} {'FOUND' if found else 'missed'}{extra}", flush=True)
            if not found:
                break   # magnitudes decrease: smaller ones are not tried
            smallest[fault] = label
    print(json.dumps({"doctor_zoo_smallest": smallest, "doctor_zoo_rows": rows, "clean_top": clean_top,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
