"""Recording overhead: the same short training run with and without the trace, side by side.

Each round runs `axrl train` twice *at the same time* — one process with the trace, one without,
one torch thread each on the 2-core machine — so whatever else loads the machine slows both
alike. The work is identical (same seed, config and thread count, so the same tokens and
updates). Reports two figures:

- `record_overhead_ratio_direct`: 1 + (time spent building and writing step files) / (step time),
  both measured inside the traced run — immune to machine noise between processes;
- `record_overhead_ratio_side_by_side`: median per-step wall time with trace / without, across
  the process pair(s) — what a user sees, noisy on a shared machine.

    python bench/record_overhead.py [--rounds 2] [--steps 6] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A short run with the quickstart's shapes; the warm-up only needs to make episodes end.
DEFAULTS = ["warmup.steps=20", "eval.every=0", "checkpoint.every=1000", "runtime.threads=1"]


def start(run_dir: Path, steps: int, trace: bool, extra: list[str]) -> subprocess.Popen:
    sets = DEFAULTS + [f"steps={steps}", f"trace.enabled={str(trace).lower()}"] + extra
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
           "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    with_trace: list[float] = []
    without: list[float] = []
    record: list[float] = []
    inside: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            dirs = {trace: Path(tmp) / f"r{r}-{trace}" for trace in (True, False)}
            procs = [start(d, args.steps, trace, args.extra) for trace, d in dirs.items()]
            if any([p.wait() for p in procs]):  # wait for both before judging
                raise SystemExit("a training run failed; run it by hand to see why")
            for trace, d in dirs.items():
                rows = metrics(d)[1:]  # step 0 warms caches
                totals = [row["step_time"] + row.get("time_record", 0.0) for row in rows]
                (with_trace if trace else without).extend(totals)
                if trace:
                    record.extend(row["time_record"] for row in rows)
                    inside.extend(row["step_time"] for row in rows)
    direct = 1 + statistics.mean(record) / statistics.mean(inside)
    side = statistics.median(with_trace) / statistics.median(without)
    print(f"steps measured: {len(with_trace)} with trace, {len(without)} without")
    print(f"record (build + write step file): mean {statistics.mean(record) * 1e3:.1f} ms "
          f"per step of {statistics.mean(inside):.2f} s")
    print(f"median step time: {statistics.median(with_trace):.3f} s with trace, "
          f"{statistics.median(without):.3f} s without")
    print(json.dumps({"record_overhead_ratio_direct": round(direct, 4),
                      "record_overhead_ratio_side_by_side": round(side, 4),
                      "record_ms_per_step": round(statistics.mean(record) * 1e3, 2)}))


if __name__ == "__main__":
    main()
