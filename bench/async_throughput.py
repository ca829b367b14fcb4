"""Asynchronous vs synchronous training on a task with a heavy tail of long episodes.

The task is `echo` with most prompts asking for one word and a share (`--tail`) asking for
`--long-turns` words; the model is the quickstart's tiny MoE at random init, which never ends a
turn early — every turn runs to `rollout.max_new_tokens` — so a long episode is exactly
`long_turns`× a short one: a controlled heavy tail (rewards are 0, the updates are computed in
full all the same). Each mode trains the same config from the same weights:

- `sync`: roll out a batch, wait for its slowest episode, train, sync;
- `async` with η = 1 and η = 2 (`rollout.max_staleness`), deterministic (count-scheduled), and
  η = 2 free-running (`runtime.deterministic=false`, wall-clock scheduling).

A synchronous step waits for the longest episode of its batch; an asynchronous one keeps the
engine full of new groups meanwhile and trains while the engine generates. Runs go one after
another, never concurrently — asynchronous training needs both cores (engine thread + trainer
thread) — and the modes alternate over `--rounds` so that machine noise hits them alike.
Throughput = trained (generated) tokens of every step per second of the whole `train()` call,
timed from outside the loop (each run in a process of its own; config loading and the
interpreter's start-up are outside the call, the model build and the pipeline's fill inside):
nothing the loop reports is subtracted. Beside it, in the same runs: the same tokens per second
of the process's wall time (timed by this script), and the earlier figure from the loop's own
phase timers (`step_time` + `time_record` over the steps after the first two).

    python bench/async_throughput.py [--rounds 2] [--steps 10]

Last line: JSON with `async_vs_sync_tokens_per_s_ratio` (the best η, train() wall time), the
three ratios side by side (`ratios_vs_sync`, `ratios_vs_sync_process_wall`,
`ratios_vs_sync_loop_timers`), the per-mode medians and staleness counts.
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
TASK_ARGS = "{turns: 1, long_turns: %d, long_share: %s}"
MODES = {
    "sync": ["runtime.mode=sync"],
    "async_eta1": ["runtime.mode=async", "rollout.max_staleness=1"],
    "async_eta2": ["runtime.mode=async", "rollout.max_staleness=2"],
    "async_eta2_free": ["runtime.mode=async", "rollout.max_staleness=2", "runtime.deterministic=false"],
}


def base_settings(steps: int, long_turns: int, share: float) -> list[str]:
    return [f"steps={steps}", "model.preset=tiny-moe", "warmup.steps=0", "data.task=echo",
            "data.task_args=" + TASK_ARGS % (long_turns, share), "data.prompts_per_step=16", "rollout.group_size=8",
            "rollout.temperature=1.0", "rollout.max_new_tokens=32", f"rollout.max_turns={long_turns}",
            "rollout.max_context_len=512", "rollout.max_batch_size=64", "rollout.partial_rollout=recompute",
            "algo.loss_agg=seq-mean-token-mean", "train.updates_per_step=1", "eval.every=0",
            "checkpoint.every=1000", "runtime.threads=1"]


# The run, timed from outside its loop: the whole `train()` call (config already loaded), in a
# process of its own; the process's wall time is taken by the parent.
RUNNER = """
import json, sys, time
from axrl.config import load_config
from axrl.assembly.build import train
cfg = load_config(sys.argv[1], sys.argv[3:])
start = time.perf_counter()
train(cfg, sys.argv[2])
print(json.dumps({"train_call_s": time.perf_counter() - start}))
"""


def run_mode(run_dir: Path, settings: list[str]) -> dict:
    cmd = [sys.executable, "-c", RUNNER, str(ROOT / "examples" / "quickstart.yaml"), str(run_dir), *settings]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    process_s = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    train_call_s = json.loads(done.stdout.strip().splitlines()[-1])["train_call_s"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["generated_tokens"] for r in rows)
    # The loop's own phase timers over the steps after the first two (the earlier figure, kept
    # beside the outside measurement for comparison).
    steady = rows[2:]
    loop_s = sum(r["step_time"] + r.get("time_record", 0.0) for r in steady)
    loop_tokens = sum(r["generated_tokens"] for r in steady)
    return {"tokens_per_s": tokens / train_call_s, "train_call_s": train_call_s, "tokens": tokens,
            "process_s": process_s, "process_tokens_per_s": tokens / process_s,
            "loop_timer_tokens_per_s": loop_tokens / loop_s, "loop_timer_s": loop_s,
            "wait_rollout_s": sum(r["time_rollout"] for r in steady), "train_s": sum(r["time_train"] for r in steady),
            "lag_max": max(r["version_lag_max"] for r in rows), "reruns": sum(r["stale_reruns"] for r in rows),
            "dropped": sum(r["stale_dropped"] for r in rows), "reward": statistics.mean(r["reward"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--long-turns", type=int, default=8, help="turns of a long episode (short ones have 1)")
    ap.add_argument("--tail", type=float, default=0.15, help="share of long episodes")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        base = base_settings(args.steps, args.long_turns, args.tail)
        for r in range(args.rounds):
            for m in modes:
                res = run_mode(Path(tmp) / f"{m}-{r}", base + MODES[m])
                results[m].append(res)
                print(f"round {r} {m:16s} {res['tokens_per_s']:7.0f} trained tok/s over train() "
                      f"({res['tokens']} tokens in {res['train_call_s']:.1f} s; process {res['process_s']:.1f} s: "
                      f"{res['process_tokens_per_s']:.0f} tok/s; loop timers {res['loop_timer_tokens_per_s']:.0f} tok/s; "
                      f"wait for rollout {res['wait_rollout_s']:.1f} s, train {res['train_s']:.1f} s, "
                      f"lag max {res['lag_max']}, reruns {res['reruns']}, dropped {res['dropped']})", flush=True)
    def medians(key: str) -> dict[str, float]:
        return {m: statistics.median(x[key] for x in results[m]) for m in modes}

    def ratios_of(med: dict[str, float]) -> dict[str, float]:
        return {m: round(med[m] / med["sync"], 3) for m in modes if m != "sync"}

    median, process, loop = medians("tokens_per_s"), medians("process_tokens_per_s"), medians("loop_timer_tokens_per_s")
    ratios = ratios_of(median)
    print(json.dumps({
        "async_vs_sync_tokens_per_s_ratio": max(ratios.values()),
        "best_eta_mode": max(ratios, key=ratios.get),
        "ratios_vs_sync": ratios,
        "ratios_vs_sync_process_wall": ratios_of(process),
        "ratios_vs_sync_loop_timers": ratios_of(loop),
        "tokens_per_s_median": {m: round(v, 1) for m, v in median.items()},
        "train_call_s": {m: [round(x["train_call_s"], 2) for x in results[m]] for m in modes},
        "process_s": {m: [round(x["process_s"], 2) for x in results[m]] for m in modes},
        "staleness": {m: {k: results[m][-1][k] for k in ("lag_max", "reruns", "dropped")} for m in modes},
        "rounds": args.rounds, "steps": args.steps, "long_turns": args.long_turns, "tail": args.tail,
    }))


if __name__ == "__main__":
    main()
