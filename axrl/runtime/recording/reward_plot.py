"""The reward plot of `examples/plot_reward.py`: held-out eval reward per run (with the final
evaluation after the last step) and the first run's training reward, from metrics.jsonl rows.
The experiment trackers (`axrl.runtime.recording.trackers`) log it as an image at the end of a run."""

from __future__ import annotations

from math import nan
from pathlib import Path
from typing import Any, Sequence

RewardRows = Sequence[dict[str, Any]]


def draw_reward(ax: Any, runs: Sequence[tuple[str, RewardRows]]) -> None:
    """Draw on a matplotlib Axes: per run (name, metrics.jsonl rows), its eval rewards; the first
    run's training reward in grey."""
    for i, (name, rows) in enumerate(runs):
        evals = [(r["step"], r["eval_reward"]) for r in rows if r.get("eval_reward") is not None]
        if rows and rows[-1].get("eval_reward_final") is not None:
            evals.append((rows[-1]["step"] + 1, rows[-1]["eval_reward_final"]))
        label = f" — {name}" if len(runs) > 1 else " (held-out prompts, fixed seeds)"
        if i == 0:
            ax.plot([r["step"] for r in rows], [nan if r.get("reward") is None else r["reward"] for r in rows],
                    color="0.6", lw=1,
                    label=f"train reward (this step's prompts){'' if len(runs) == 1 else ' — ' + name}")
        if evals:
            ax.plot(*zip(*evals), "o-", color=f"C{i}", lw=2, label=f"eval reward{label}")
    ax.set_xlabel("RL step (eval at step s = policy before step s)")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def save_reward_plot(runs: Sequence[tuple[str, RewardRows]], out: Path, *, title: str | None = None) -> Path:
    """Render `draw_reward` to a PNG file (matplotlib's Agg backend, no display needed)."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot state, no GUI backend

    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    draw_reward(ax, runs)
    ax.set_title(title if title is not None else " vs ".join(name for name, _ in runs))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
