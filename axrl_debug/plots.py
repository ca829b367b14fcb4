"""PNG figures for ``axrl-debug mismatch --plot DIR`` (matplotlib, Agg backend: no display needed).

Files written (only those with data):
    mismatch_abs_delta_hist.png   histogram of log10 |Δ| (exact zeros counted in the title)
    mismatch_prob_scatter.png     rollout vs trainer probability of (a subsample of) analysed tokens
    mismatch_breakdowns.png       mean |Δ| per bucket: position, turn, rollout prob, entropy, lag, routing
    mismatch_routing_layers.png   per-layer routing agreement / overlap (MoE traces)
    mismatch_per_step.png         mean and max |Δ| per step (more than one step)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: CI machines and SSH sessions have no display
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, rows: list[dict[str, Any]], title: str) -> None:
    rows = [r for r in rows if r["count"]]
    labels = [str(r["bucket"]) for r in rows]
    values = [r["mean_abs"] for r in rows]
    ax.bar(range(len(rows)), values, color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    for i, r in enumerate(rows):
        ax.annotate(str(r["count"]), (i, values[i]), ha="center", va="bottom", fontsize=6, color="gray")
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("mean |Δ|", fontsize=8)


def mismatch_plots(acc: Any, res: dict[str, Any], out_dir: Path | str) -> list[Path]:
    """Write the mismatch figures for an accumulator and its result; returns the paths."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    ad = acc.abs_deltas()
    if ad.size:
        nz = ad[ad > 0]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if nz.size:
            ax.hist(np.log10(nz), bins=60, color="tab:blue")
        ax.set_xlabel("log10 |Δ|   (Δ = trainer − rollout logprob)")
        ax.set_ylabel("tokens")
        ax.set_title(f"{ad.size} analysed tokens, {ad.size - nz.size} with Δ = 0 exactly", fontsize=9)
        save(fig, "mismatch_abs_delta_hist.png")

    x, y = acc.plot_pairs()
    if x.size:
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        ax.scatter(x, y, s=2, alpha=0.3, color="tab:blue", rasterized=True)
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        ax.set_xlabel("rollout probability")
        ax.set_ylabel("trainer probability")
        ax.set_title(f"Pearson r = {res['metrics']['pearson_prob']:.6g}", fontsize=9)
        save(fig, "mismatch_prob_scatter.png")

    panels = [(name, rows) for name, rows in (res.get("breakdowns") or {}).items()]
    if res.get("routing"):
        panels.append(("routing (row t−1)", res["routing"]["delta"]))
    if panels:
        ncols = 3
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(11, 3.2 * nrows), squeeze=False)
        for ax, (name, rows) in zip(axes.flat, panels):
            _bars(ax, rows, name)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        save(fig, "mismatch_breakdowns.png")

    if res.get("routing"):
        layers = res["routing"]["layers"]
        fig, ax = plt.subplots(figsize=(6, 3))
        idx = np.arange(len(layers))
        ax.bar(idx - 0.2, [l["agreement"] for l in layers], width=0.4, label="same expert set")
        ax.bar(idx + 0.2, [l["overlap"] for l in layers], width=0.4, label="mean overlap")
        ax.set_xticks(idx, [str(l["layer"]) for l in layers])
        ax.set_xlabel("MoE layer")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title("routing agreement, rollout vs trainer", fontsize=9)
        save(fig, "mismatch_routing_layers.png")

    per_step = res.get("per_step") or []
    if len(per_step) > 1:
        steps = [p["step"] for p in per_step]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(steps, [p["mean_abs"] for p in per_step], marker="o", ms=3, label="mean |Δ|")
        ax.plot(steps, [p["max_abs"] for p in per_step], marker=".", ms=3, label="max |Δ|")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        save(fig, "mismatch_per_step.png")
    return written


def explain_plot(token: dict[str, Any], out_dir: Path | str, step: int) -> Path:
    """``axrl-debug explain --plot DIR``: one figure per token, `explain_step{N}_sample{S}_token{T}.png`.
    Left: the hidden-state norm at the predicting position after each hook point, both paths, and
    their relative distance per component. Right: the logprob gap left after patching the engine's
    state at each point (the activation-patching curve; 0 at the logits by construction)."""
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = token["rows"]
    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    norms = [v for k, v in token["hidden_norms"].items() if k != "logits"]  # residual stream only
    ax1.plot(x[:len(norms)], [n[0] for n in norms], "o-", label="engine ‖h‖", color="tab:orange")
    ax1.plot(x[:len(norms)], [n[1] for n in norms], "s--", label="trainer ‖h‖", color="tab:blue")
    ax1.set_ylabel("hidden-state norm after the component", fontsize=8)
    twin = ax1.twinx()
    twin.bar(x, [max(r["rel_diff"], 1e-12) for r in rows], alpha=0.3, color="tab:red", label="rel. distance")
    twin.set_yscale("log")
    twin.set_ylabel("‖engine − trainer‖ / ‖trainer‖ of its output", fontsize=8)
    ax1.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    ax1.legend(fontsize=7, loc="upper left")
    ax1.set_title("divergence by layer (predicting position)", fontsize=9)
    ax2.axhline(0, color="gray", lw=0.5)
    ax2.plot(x, [r["remaining_gap"] for r in rows], "o-", color="tab:purple")
    ax2.axhline(token["gap"], color="tab:red", ls=":", lw=1, label=f"gap {token['gap']:+.3g}")
    if token["r3_gap"] == token["r3_gap"]:
        ax2.axhline(token["r3_gap"], color="tab:green", ls="--", lw=1, label=f"with R3 {token['r3_gap']:+.3g}")
    ax2.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("trainer − engine logprob after patching", fontsize=8)
    ax2.legend(fontsize=7)
    ax2.set_title(f"activation patching: named {token['named']}", fontsize=9)
    fig.suptitle(f"step {step}, sample {token['sample_id']}, token {token['token']} {token['text']!r}", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"explain_step{step}_sample{token['sample_id']}_token{token['token']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
