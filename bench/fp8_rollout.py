"""Low-precision rollout: the mismatch fp8 weights (and an fp8 KV cache) add, and what the
corrections recover.

Two measurements, both from real CPU runs of the quickstart (calculator, tiny MoE):

1. Training runs, one per variant, side by side (`--parallel` at a time, each in its own
   process): the rollout engine in fp32, bf16 and fp8 (each with the quickstart's TIS), and fp8
   with no correction, with IcePop instead of TIS, and with R3. Per run: the mismatch of its
   rollout logprobs against the fp32 trainer over all steps (`axrl-debug mismatch --json`: mean
   |Δ|, k3, by position and by token), routing agreement, and the eval curve (metrics.jsonl).
2. The same tokens under every precision: the fp32 run's last checkpointed step teacher-forced through the
   embedded engine's decode path (`replay.rollout.teacher_forced_check`, i.e.
   `axrl-debug replay --rollout --engine embedded`) with the run's config set to each rollout
   precision; `trainer − embedded decode` is then the gap that precision alone adds.

Then `axrl-debug explain` on the fp8 run's same step attributes its gap per layer.

    python bench/fp8_rollout.py [--steps 20] [--parallel 3] [--out runs/bench_fp8] [--reuse]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SMALL = ["data.prompts_per_step=8", "eval.every=5", "eval.prompts=32", "checkpoint.every=5", "runtime.threads=1"]
VARIANTS = {
    "fp32": ["rollout.weight_dtype=fp32"],
    "bf16": ["rollout.weight_dtype=bf16"],
    "fp8": ["rollout.weight_dtype=fp8"],
    "fp8_no_correction": ["rollout.weight_dtype=fp8", "algo.tis=false"],
    "fp8_icepop": ["rollout.weight_dtype=fp8", "algo.tis=false", "algo.correction={icepop: {low: 0.5, high: 5.0}}"],
    "fp8_r3": ["rollout.weight_dtype=fp8", "r3=true"],
}
SAME_TOKENS = {"fp32": {}, "bf16": {"weight_dtype": "bf16"}, "fp8": {"weight_dtype": "fp8"},
               "fp8_kv": {"kv_dtype": "fp8"}, "fp8_weights_and_kv": {"weight_dtype": "fp8", "kv_dtype": "fp8"}}


def launch(out: Path, steps: int, names: list[str]) -> list[tuple[str, subprocess.Popen]]:
    """Start `axrl train` of the quickstart for each variant (logs beside the run directories)."""
    procs = []
    for name in names:
        args = [sys.executable, "-m", "axrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
                "--run-dir", str(out / name)]
        for s in [f"steps={steps}", *SMALL, *VARIANTS[name]]:
            args += ["--set", s]
        log = open(out / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "PYTHONPATH": str(ROOT)})))
    return procs


def train_all(out: Path, steps: int, parallel: int, reuse: bool) -> dict[str, float]:
    """Every variant's run (`parallel` at a time); wall seconds per run."""
    todo = [n for n in VARIANTS if not (reuse and (out / n / "manifest.json").is_file())]
    for n in todo:
        shutil.rmtree(out / n, ignore_errors=True)
    wall: dict[str, float] = {}
    for i in range(0, len(todo), parallel):
        t0 = time.perf_counter()
        for name, p in launch(out, steps, todo[i:i + parallel]):
            if p.wait() != 0:
                raise SystemExit(f"run {name} failed: see {out / f'{name}.log'}")
            wall[name] = time.perf_counter() - t0
    return wall


def debug_json(*args: str) -> dict:
    """`axrl-debug ARGS --json` in a child process, parsed."""
    res = subprocess.run([sys.executable, "-m", "axrl_debug.cli", *args, "--json"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(res.stdout)


def brief(rows: list[dict]) -> list[dict]:
    """A breakdown's buckets without their shares."""
    return [{k: r[k] for k in ("bucket", "count", "mean_abs")} for r in rows]


def run_metrics(run: Path) -> dict:
    """Mismatch over all steps, routing agreement, reward and the eval curve of one run."""
    mm = debug_json("mismatch", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
    train = [r for r in rows if r.get("reward") is not None]
    m, routing = mm["metrics"], mm.get("routing") or {}
    steps = debug_json("summary", str(run))["steps"]
    rules = {k: sum(r.get(k) or 0.0 for r in steps) / len(steps)
             for k in ("rule_tis_truncated_frac", "rule_icepop_masked_frac", "is_weight_mean", "frac_above_tis_cap")}
    return {"mean_abs": m["mean_abs"], "k3": m["k3"], "max_abs": m["max_abs"], "tokens": mm["tokens"]["analysed"],
            "routing_agreement": routing.get("agreement"), "corrections": rules,
            "by_position": brief(mm["breakdowns"]["position"]),
            "by_token_prob": brief(mm["breakdowns"]["rollout_prob"]),
            "eval_curve": evals, "final_eval": evals[-1][1] if evals else None,
            "mean_train_reward": sum(r["reward"] for r in train) / max(len(train), 1)}


def same_tokens(run: Path, step: int, work: Path) -> dict[str, dict]:
    """The gap each rollout precision adds on exactly the tokens of `run`'s step `step`."""
    from replay.rollout import teacher_forced_check

    out = {}
    for name, update in SAME_TOKENS.items():
        copy = work / f"same_tokens_{name}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(run, copy)
        cfg = yaml.safe_load((copy / "config.yaml").read_text())
        cfg["rollout"].update({"weight_dtype": "fp32", "kv_dtype": "auto", **update})
        (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
        s = teacher_forced_check(copy, step).summary
        out[name] = {"mean_abs_trainer_vs_engine": s["mean_abs_trainer_vs_embedded"],
                     "max_abs_trainer_vs_engine": s["max_abs_trainer_vs_embedded"]}
        shutil.rmtree(copy)
    return out


def explain_layers(res: dict) -> list[dict]:
    """Per explained token: its gap, explain's verdict and each component's share of the gap."""
    return [{"sample_id": t["sample_id"], "token": t["token"], "gap": t["gap"], "named": t["named"],
             "r3_gap": t.get("r3_gap"), "shares": {r["name"]: round(r["share"], 3) for r in t["rows"]}}
            for t in res["tokens"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_fp8")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs in --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wall = train_all(args.out, args.steps, args.parallel, args.reuse)
    runs = {n: run_metrics(args.out / n) for n in VARIANTS}
    for n, r in runs.items():
        print(f"{n:>18}: mean|Δ| {r['mean_abs']:.3g}  k3 {r['k3']:.3g}  routing {r['routing_agreement']}  "
              f"eval {[round(v, 3) for _, v in r['eval_curve']]}  "
              f"train reward {r['mean_train_reward']:.3f}", flush=True)
    last = (args.steps - 1) // 5 * 5  # a checkpointed step (checkpoint.every=5): no steps to re-run first
    tokens = same_tokens(args.out / "fp32", last, args.out)
    print(f"same tokens (fp32 run, step {last}): {tokens}", flush=True)
    explain = explain_layers(debug_json("explain", str(args.out / "fp8"), "--step", str(last)))
    print(f"explain fp8 step {last}: {explain}", flush=True)
    print(json.dumps({"steps": args.steps, "wall_s": wall, "runs": runs, "same_tokens_step": last,
                      "same_tokens": tokens, "explain_fp8": explain}, default=str))


if __name__ == "__main__":
    main()
