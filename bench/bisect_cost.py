"""Bisect cost: `axrl-debug bisect` of one sample of a quickstart step, relative to the time
training spent on that step.

Records a short quickstart run (`examples/quickstart.yaml`: the tiny MoE, 16 prompts × 8 samples per
step, its warm-up; `--steps` RL steps, eval off, a checkpoint before every step) with `axrl train` in a
child process, then calls `replay.bisect.bisect_step` on one sample (the step's largest gap) in this
process and prints its time beside the step's recorded `train` phase (its optimizer updates). The
bisect time is the whole call: rebuilding the policy (trainer built, checkpoint loaded), the engine
path (every request of the step, teacher-forced, capturing the sample), the engine's float64 (and,
with a quantised cache, fp32) reference of the sample alone, the trainer's micro-batch as trained
and its float64 reference, and the comparison of every probe point.

On a shared machine the recording and the bisect call can run under very different load, so the
step's training is also re-executed here, side by side (`replay.replay_step`, its updates timed):
`bisect_over_replayed_train` divides by that; `bisect_over_step` (the issue's definition) by the
recorded train phase.

    python bench/bisect_cost.py [--steps 2] [--step 1] [--run RUN] [--set key=value ...]

Last line: one JSON object; `bisect_over_step` is the headline (target ≤ 5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import replay_cost  # noqa: E402  (its recording recipe)
DEFAULTS = ["eval.every=0", "checkpoint.every=1", "runtime.threads=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--step", type=int, default=1, help="the step to bisect")
    ap.add_argument("--run", type=Path, default=None, help="use this recorded run instead of recording one")
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from axrl.trace import StepFile
    from replay import replay_step
    from replay.bisect import bisect_step

    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if run is None:
            run = Path(tmp) / "run"
            t0 = time.perf_counter()
            replay_cost.record(run, args.steps, args.extra, defaults=DEFAULTS)
            print(f"recorded {args.steps} quickstart step(s) in {time.perf_counter() - t0:.1f} s "
                  "(incl. process start-up, warm-up)")
        with StepFile(run / "trace" / f"step_{args.step:06d}.h5") as sf:
            train_s = float(sf.wall_times["train"])
            tokens = int(sf["/samples/offsets"][-1])
            samples = len(sf["/samples/offsets"]) - 1
        replayed = replay_step(run, args.step)  # also warms the process up
        train_now = replayed.timings["updates_seconds"]
        t0 = time.perf_counter()
        res = bisect_step(run, args.step)
        wall = time.perf_counter() - t0
        t = res.timings
        f = res.fidelity["engine_path_vs_rollout_logprob"]
        print(f"step {args.step}: {samples} samples, {tokens} tokens; recorded train phase {train_s:.3f} s; "
              f"updates re-executed here {train_now:.3f} s ({replayed.verdict})")
        print(f"bisect of sample {res.sample_id}: {wall:.2f} s = rebuild {t['rebuild_seconds']:.2f} + engine (step + "
              f"references) {t['engine_seconds']:.2f} + trainer (micro-batch + float64) {t['trainer_seconds']:.2f} + "
              f"compare {t['compare_seconds']:.2f}; engine path reproduces {f['bitwise_equal']} of {f['tokens']} "
              f"rollout logprobs bit for bit; first divergence {res.first_divergence()}")
        print(json.dumps({"bisect_s": round(wall, 3), "step_train_s": round(train_s, 3),
                          "step_train_replayed_s": round(train_now, 3),
                          "bisect_over_replayed_train": round(wall / train_now, 3),
                          "bisect_over_step": round(wall / train_s, 3)}))


if __name__ == "__main__":
    main()
