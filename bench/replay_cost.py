"""Replay cost: re-executing a recorded step vs the time training spent on it, side by side.

Records a short run with `axrl train` in a child process (tiny MoE, echo task so rewards vary
and every update has a real gradient, a checkpoint before every step so each replay is exactly
one step), then replays every step in this process with `replay.replay_step`, `--repeats`
times each. Process start-up is excluded (the first replay loads the tokenizer and warms the
kernels; the per-step median drops it). Reported per step:

- `replay_vs_recorded_step_ratio`: re-execution of the step (old-logprob forward + the
  optimizer updates, as `axrl-debug replay` runs them) / the recorded `prepare + train` phases
  (the same work in training, plus packing the batch);
- `replay_vs_recorded_updates_ratio`: the updates alone / the recorded `train` phase;
- `replay_total_s`: wall time of one whole replay call (checkpoint load, trace read, step,
  comparison), for reference.

Ratios are medians over steps of (median replay / recorded). Target: ≤ 1.5×.

    python bench/replay_cost.py [--steps 6] [--repeats 3] [--set key=value ...]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULTS = ["model.preset=tiny-moe", "data.task=echo", "data.task_args={}", "data.prompts_per_step=8",
            "rollout.group_size=8", "warmup.steps=60", "eval.every=0", "checkpoint.every=1", "runtime.threads=1"]


def record(run_dir: Path, steps: int, extra: list[str], defaults: list[str] | None = None) -> None:
    """Train the quickstart for `steps` with `defaults` (this bench's) + `extra` settings, silently."""
    sets = (DEFAULTS if defaults is None else defaults) + [f"steps={steps}"] + extra
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
           "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from replay import replay_step

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        record(run, args.steps, args.extra)
        print(f"recorded {args.steps} steps in {time.perf_counter() - t0:.1f} s (incl. process start-up, warm-up)")
        step_ratios, update_ratios, totals, equal = [], [], [], 0
        print(f"{'step':>4} {'recorded s':>11} {'replay s':>9} {'ratio':>6} {'updates':>8} {'ratio':>6}  verdict")
        for step in range(args.steps):
            runs = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                result = replay_step(run, step)
                totals.append(time.perf_counter() - t)
                runs.append(result)
            equal += all(r.verdict == "bitwise-equal" for r in runs)
            tm = runs[0].timings
            replay_s = statistics.median(r.timings["step_seconds"] for r in runs)
            updates_s = statistics.median(r.timings["updates_seconds"] for r in runs)
            step_ratios.append(replay_s / tm["recorded_step_seconds"])
            update_ratios.append(updates_s / tm["recorded_train_seconds"])
            print(f"{step:>4} {tm['recorded_step_seconds']:>11.3f} {replay_s:>9.3f} {step_ratios[-1]:>6.2f} "
                  f"{updates_s:>8.3f} {update_ratios[-1]:>6.2f}  {runs[0].verdict}")
    print(json.dumps({"replay_vs_recorded_step_ratio": round(statistics.median(step_ratios), 3),
                      "replay_vs_recorded_updates_ratio": round(statistics.median(update_ratios), 3),
                      "replay_total_s": round(statistics.median(totals), 3),
                      "bitwise_equal_steps": f"{equal}/{args.steps}"}))


if __name__ == "__main__":
    main()
