"""Plot a run's training and held-out eval reward from metrics.jsonl.

    python examples/plot_reward.py runs/quickstart --out reward.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=Path("reward.png"))
    args = ap.parse_args()
    rows = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    evals = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
    if rows and rows[-1].get("eval_reward_final") is not None:
        evals.append((rows[-1]["step"] + 1, rows[-1]["eval_reward_final"]))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["reward"] for r in rows], color="0.6", lw=1, label="train reward (this step's prompts)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="C0", lw=2, label="eval reward (held-out prompts, fixed seeds)")
    ax.set_xlabel("RL step (eval at step s = policy before step s)")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{args.run.name}: calculator tool use")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
