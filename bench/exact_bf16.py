"""What `rollout.exact: true` changes in training where the mismatch is real: the quickstart in
bf16 (`model.dtype: bfloat16`, engine and trainer), normal vs exact, with and without TIS — the
same reduced quickstart as bench/fp8_rollout.py (8 prompts a step, eval of 32 held-out questions
every 5 steps), each run from its own warm-up with the same seed.

    OMP_NUM_THREADS=1 python bench/exact_bf16.py --steps 10 --parallel 2 --plot docs/img/exact_bf16.png

Prints each run's eval curve, mismatch and train reward; the last line is one JSON object with
`<variant>_final_eval`, `<variant>_mean_abs_delta` and the curves (`runs`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fp8_rollout as fr  # noqa: E402  (the same reduced quickstart, launcher and per-run metrics)

BF16 = ["model.dtype=bfloat16"]
VARIANTS = {
    "bf16_tis": BF16,
    "bf16_no_tis": [*BF16, "algo.tis=false"],
    "bf16_exact_tis": [*BF16, "rollout.exact=true"],
    "bf16_exact_no_tis": [*BF16, "rollout.exact=true", "algo.tis=false"],
}


def plot(runs: dict[str, dict], path: Path) -> None:
    """The runs' eval curves side by side (one line per variant)."""
    import matplotlib

    matplotlib.use("Agg", force=True)   # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in runs.items():
        steps, rewards = zip(*r["eval_curve"]) if r["eval_curve"] else ((), ())
        ax.plot(steps, rewards, marker="o", linestyle="--" if "no_tis" in name else "-", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("eval reward (32 held-out questions)")
    ax.set_title("quickstart in bf16: normal vs rollout.exact, with and without TIS", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_exact_bf16")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs in --out")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="an extra override for every run")
    ap.add_argument("--plot", type=Path, default=None, help="write the eval curves to this PNG")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = list(VARIANTS)
    wall = fr.train_all(args.out, args.steps, args.parallel, args.reuse, names, args.extra, VARIANTS)
    runs = {n: fr.run_metrics(args.out / n) for n in names}
    for n, r in runs.items():
        print(f"{n:>18}: mean|Δ| {r['mean_abs']:.3g}  max|Δ| {r['max_abs']:.3g}  "
              f"eval {[round(v, 3) for _, v in r['eval_curve']]}  train reward {r['mean_train_reward']:.3f}",
              flush=True)
    if args.plot is not None:
        plot(runs, args.plot)
    flat = {f"{n}_final_eval": r["final_eval"] for n, r in runs.items()}
    flat.update({f"{n}_mean_abs_delta": r["mean_abs"] for n, r in runs.items()})
    print(json.dumps({**flat, "steps": args.steps, "extra": args.extra, "wall_s": wall, "runs": runs}, default=str))


if __name__ == "__main__":
    main()
