"""What the bisect tests share: the small recorded run they bisect, the engine-only expert
perturbation they plant, and the positions the recorded routing sent to that expert."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from axrl.trace import StepFile


def small_run(preset: str = "micro-moe") -> list[str]:
    """One recorded step (step 0, with the checkpoint before it) of a small MoE model, multi-turn
    samples, the engine's prefix cache on (as the default run)."""
    return ["steps=1", f"model.preset={preset}", "warmup.steps=30", "data.task=echo", "data.task_args={}",
            "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
            "checkpoint.every=1", "rollout.max_new_tokens=12", "train.micro_batch_tokens=200"]


EXPERT = (1, 2)  # (layer, expert) perturbed in the engine's copy only


def perturbed_expert(layer: int, expert: int, scale: float = 1.05) -> Callable[[dict], dict]:
    """`engine_weights` for bisect: the expert's down projection scaled in the engine's copy only."""
    def perturb(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w = dict(weights)
        key = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
        w[key] = w[key] * scale
        return w
    return perturb


def routed_positions(run: Path, sample_id: int, layer: int, expert: int) -> tuple[list[int], int]:
    """The positions of `sample_id` (step 0) whose recorded routing at `layer` chose `expert`, and
    how many positions were fed to the model (all but the last token)."""
    with StepFile(sorted((run / "trace").glob("*.h5"))[0]) as sf:
        sids, off = sf["/samples/sample_id"], sf["/samples/offsets"]
        row = int(np.flatnonzero(sids == sample_id)[0])
        routing = sf["/routing/rollout"][int(off[row]):int(off[row + 1]) - 1]
    return [int(p) for p in np.flatnonzero((routing[:, layer] == expert).any(-1))], len(routing)
