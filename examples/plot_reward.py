"""Plot runs' held-out eval reward (and the first run's training reward) from metrics.jsonl.

    python examples/plot_reward.py runs/quickstart --out reward.png
    python examples/plot_reward.py runs/quickstart runs/quickstart_async --out sync_vs_async.png

The same plot is logged at the end of a run by `logging.wandb` / `logging.mlflow` (docs/train.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from axrl.runtime.recording.reward_plot import save_reward_plot
from axrl.trace import read_metrics_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=Path("reward.png"))
    ap.add_argument("--task", default="calculator tool use", help="what the runs train (the title's end)")
    args = ap.parse_args()
    runs = [(run.name, read_metrics_file(run / "metrics.jsonl")[0]) for run in args.runs]
    save_reward_plot(runs, args.out, title=" vs ".join(run.name for run in args.runs) + f": {args.task}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
