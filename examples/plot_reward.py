"""Plot runs' held-out eval reward (and the first run's training reward) from metrics.jsonl.

    python examples/plot_reward.py runs/quickstart --out reward.png
    python examples/plot_reward.py runs/quickstart runs/quickstart_async --out sync_vs_async.png
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
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path("reward.png"))
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, run in enumerate(args.runs):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
        if rows and rows[-1].get("eval_reward_final") is not None:
            evals.append((rows[-1]["step"] + 1, rows[-1]["eval_reward_final"]))
        name = f" — {run.name}" if len(args.runs) > 1 else " (held-out prompts, fixed seeds)"
        if i == 0:
            ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], color="0.6", lw=1,
                    label=f"train reward (this step's prompts){'' if len(args.runs) == 1 else ' — ' + run.name}")
        if evals:
            ax.plot(*zip(*evals), "o-", color=f"C{i}", lw=2, label=f"eval reward{name}")
    ax.set_xlabel("RL step (eval at step s = policy before step s)")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(" vs ".join(run.name for run in args.runs) + ": calculator tool use")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
