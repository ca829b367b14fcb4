"""`runtime.executor: ray`: what passes through the driver per step, and Ray's step-time overhead.

Runs the quickstart config (tiny MoE at random init, no warm-up, no eval: every turn runs long,
so the byte counts are an upper bound) on a local 2-CPU Ray cluster at three shapes — the
quickstart's 16 prompts × 8 samples, 10× the prompts with two data-parallel train ranks, and the
quickstart shape on the Megatron backend with expert parallel 2 (so data parallel 2: two Megatron
rank actors, each with half of every micro-batch) — plus the quickstart shape with
`runtime.executor: local` for the step-time ratio. Each ray run writes RUN/data_plane.json
(axrl/ray_executor/handles.py: `DataPlane`): what crossed the driver, measured in the driver
process (axrl/ray_executor/wire.py: every `ray.get`, `ray.put`, actor call and actor start, at
Ray's serialised size, each object once; start-up, heartbeats, checkpoint calls and the close
included), and each object an actor put in the object store for another actor (batch, shards,
weight snapshots, Megatron shares), once, at its serialised size; plus what each train rank (and
Megatron rank) fetched against its share (tensor bytes).

    python bench/ray_data_plane.py [--steps 3] [--big-steps 2] [--rounds 2]

Last line: JSON with `driver_bytes_fraction` (all the run's driver bytes / the bytes put by
reference between actors, the largest over the shapes), the per-shape breakdowns, per-rank fetched vs share, and `ray_vs_local_step_time`.
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
BASE = ["warmup.steps=0", "eval.every=0", "checkpoint.every=100", "runtime.threads=1"]


def run(run_dir: Path, steps: int, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"), "--run-dir",
           str(run_dir), "--set", f"steps={steps}", *[a for s in [*BASE, *extra] for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return run_dir


def step_times(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["step_time"] for m in lines]


def plane(run_dir: Path, steps: int) -> dict:
    """The run's RUN/data_plane.json per step. `driver`: measured in the driver process at Ray's
    serialised size (every get / put / actor call / actor start, each object once), start-up
    included ("start <actor>": the settings handed to each actor). `by_ref`: each object an actor
    put in the object store for another actor, once, at its serialised size — the denominator."""
    p = json.loads((run_dir / "data_plane.json").read_text())
    driver, by_ref = sum(p["driver"].values()), sum(p["by_ref"].values())
    startup = sum(n for k, n in p["driver"].items() if k.startswith("start "))
    return {"steps": steps, "driver_bytes_per_step": driver / steps, "payload_bytes_per_step": by_ref / steps,
            "driver_bytes_fraction": driver / by_ref,
            "driver_bytes_total": driver, "driver_startup_bytes": startup,
            "driver_bytes_per_step_without_startup": (driver - startup) / steps,
            "driver_by_category_per_step": {k: v / steps for k, v in sorted(p["driver"].items())},
            "by_reference_per_step": {k: v / steps for k, v in sorted(p["by_ref"].items())},
            "actor_calls_tensor_bytes_per_step": {k: v / steps for k, v in sorted(p.get("actor_calls", {}).items())},
            "rank_fetched_bytes": p["rank_fetched"], "rank_share_bytes": p["rank_share"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3, help="steps of the quickstart-shape runs")
    ap.add_argument("--big-steps", type=int, default=2, help="steps of the 10x-batch run")
    ap.add_argument("--rounds", type=int, default=2, help="alternating local / ray runs for the step time")
    args = ap.parse_args()
    ray_args = ["runtime.executor=ray", "runtime.ray.num_cpus=2", "runtime.ray.placement.train_cpus=0.5",
                "runtime.ray.placement.engine_cpus=0.5"]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        # Local and ray runs alternate over the rounds, so machine noise hits both alike.
        local_times, ray_times = [], []
        for i in range(args.rounds):
            local_times += step_times(run(t / f"local{i}", args.steps))[1:]
            quick = run(t / f"ray{i}", args.steps, *ray_args)
            ray_times += step_times(quick)[1:]
        big = run(t / "ray_10x", args.big_steps, *ray_args, "data.prompts_per_step=160", "runtime.ray.train_ranks=2",
                  "rollout.max_batch_size=128")
        megatron = run(t / "ray_megatron", args.big_steps, *ray_args, "train.backend=megatron",
                       "train.megatron.expert_parallel=2")
        shapes = {"quickstart_16x8": plane(quick, args.steps), "batch_10x_160x8_dp2": plane(big, args.big_steps),
                  "megatron_ep2_dp2_16x8": plane(megatron, args.big_steps)}
        # Steady state: the first step of each run includes start-up (cluster, actors, first sync).
        local_t, ray_t = statistics.median(local_times), statistics.median(ray_times)
    for name, s in shapes.items():
        print(f"{name}: driver {s['driver_bytes_per_step']:.0f} B/step of payload "
              f"{s['payload_bytes_per_step'] / 1e6:.2f} MB/step ({100 * s['driver_bytes_fraction']:.3f} %); "
              f"driver: {', '.join(f'{k} {v:.0f} B' for k, v in s['driver_by_category_per_step'].items())}; "
              f"by reference: {', '.join(f'{k} {v / 1e6:.2f} MB' for k, v in s['by_reference_per_step'].items())}")
        print(f"  per rank fetched {s['rank_fetched_bytes']} vs share {s['rank_share_bytes']}")
    print(f"step time (median of steps after the first, {args.rounds} alternating rounds): local {local_t:.2f} s "
          f"{sorted(round(x, 2) for x in local_times)}, ray {ray_t:.2f} s {sorted(round(x, 2) for x in ray_times)}")
    print(json.dumps({"driver_bytes_fraction": max(s["driver_bytes_fraction"] for s in shapes.values()),
                      "target_driver_bytes_fraction": 0.01, "shapes": shapes,
                      "step_time_local_s": local_t, "step_time_ray_s": ray_t,
                      "step_times_local_s": local_times, "step_times_ray_s": ray_times,
                      "ray_vs_local_step_time": ray_t / local_t}))


if __name__ == "__main__":
    main()
