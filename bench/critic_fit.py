"""Why the critic explains so little: fit PPO's critic to a recorded run's returns under several
settings, on fixed data, and measure the explained variance of held-out returns.

Input: a run directory with step files (`trace/step_N.h5`) and the checkpoint `step_000000` (the
policy at RL start, after the supervised warm-up; e.g. the quickstart trained with GRPO). The data
are fixed (the recorded episodes), so only the critic's settings differ between the rows: each row
starts a fresh critic from that policy (`axrl.train.critic.Critic`, the run's own code) and feeds
it the recorded steps in order, as a run would: values of step k's batch before training on it
(V_old: the critic has never seen these episodes, so they are held out), then GAE (γ = 1, the
row's λ, outcome credit) from those values and the row's updates on its returns with its clip.
Each row sets the value head's initial weight itself (`zero`: the old init; `random`: N(0, 0.02²),
`axrl.train.critic.initial_value_head`'s; `small`: N(0, 0.001²)), so old and new init compare on
the same data.

Reported per row, for each step k: EV_k = 1 − Var(R − V_old) / Var(R) over the batch's trained
tokens, with R the episode's reward on each of its tokens (what "explained variance of returns"
means; independent of λ). Two references on the same tokens: `prompt_ceiling`, the EV of the
leave-one-out group mean (the mean reward of the sample's group without it: a value that knows
the prompt's expected reward and nothing about the answer; a value that reads only the prompt
cannot beat the true per-prompt mean, which this estimates from the other samples — values at
later tokens also see the answer and could), and
`lambda_target_share`, the share of Var(R) the row's λ-return targets carry.

    python bench/critic_fit.py RUN [--steps 0-7] [--groups 8] [--rows example_zero,lr1e-3_random_lam1_4upd,...]

Ends with one JSON line: per row its EV per step and the mean over the last half
(`ev_last_half`), `prompt_ceiling` (mean), the settings of each row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.algo.gae import gae, token_rewards  # noqa: E402
from axrl.train.value_loss import explained_variance  # noqa: E402
from axrl.algo.processor import update_splits  # noqa: E402
from axrl.runtime.teacher import load_teacher  # noqa: E402
from axrl.train.critic import Critic, CriticConfig, critic_batch  # noqa: E402
from axrl.train.protocol import PackedBatch  # noqa: E402

# name: (lr, updates_per_step, value_clip, lam, head weight: "zero" | "random" N(0, 0.02²) | "small" N(0, 0.001²))
ROWS = {
    "default_zero": (1e-5, 1, 0.2, 0.95, "zero"),         # the old defaults: critic lr 1e-5, λ 0.95, zero head
    "example_zero": (3e-4, 2, 0.2, 0.95, "zero"),         # examples/quickstart_ppo.yaml before
    "example_zero_lam1": (3e-4, 2, 0.2, 1.0, "zero"),
    "lr1e-3_zero_lam1_4upd": (1e-3, 4, 0.2, 1.0, "zero"),
    "default_random": (1e-5, 1, 0.2, 0.95, "random"),
    "example_random": (3e-4, 2, 0.2, 0.95, "random"),
    "example_random_lam1": (3e-4, 2, 0.2, 1.0, "random"),
    "example_random_noclip": (3e-4, 2, None, 0.95, "random"),
    "lr1e-3_random_lam1": (1e-3, 2, 0.2, 1.0, "random"),
    "lr1e-3_random_lam1_4upd": (1e-3, 4, 0.2, 1.0, "random"),
    "lr1e-3_small_lam1_4upd": (1e-3, 4, 0.2, 1.0, "small"),
    "lr1e-3_small_lam1": (1e-3, 2, 0.2, 1.0, "small"),
    "lr3e-4_small_lam1_4upd": (3e-4, 4, 0.2, 1.0, "small"),
    "lr3e-3_random_lam1_4upd": (3e-3, 4, 0.2, 1.0, "random"),
    "lr1e-3_random_lam1_8upd_noclip": (1e-3, 8, None, 1.0, "random"),
}


def load_step(path: Path, groups: int) -> tuple[PackedBatch, np.ndarray, np.ndarray, np.ndarray]:
    """(batch of the first `groups` groups, rewards [N], group ids [N], turn [T]) of a step file."""
    with h5py.File(path) as f:
        off = f["samples/offsets"][:].astype(np.int64)
        gid = f["samples/group_id"][:].astype(np.int64)
        n = int(np.searchsorted(np.cumsum(np.r_[1, np.diff(gid) != 0]), groups + 1))
        T = int(off[n])
        batch = PackedBatch(input_ids=torch.from_numpy(f["tokens/ids"][:T].astype(np.int64)),
                            offsets=torch.from_numpy(off[:n + 1]),
                            loss_mask=torch.from_numpy((f["tokens/loss_mask"][:T] > 0).astype(np.float32)))
        return batch, f["samples/reward"][:n].astype(np.float64), gid[:n], f["tokens/turn"][:T].astype(np.int64)


def per_token(values: np.ndarray, batch: PackedBatch) -> torch.Tensor:
    """A per-sample quantity on every token of its sample."""
    return torch.repeat_interleave(torch.from_numpy(values).float(), batch.lengths)


def prompt_ceiling(batch: PackedBatch, rewards: np.ndarray, gid: np.ndarray) -> float:
    """EV of the leave-one-out group mean reward against the reward, over trained tokens."""
    loo = np.empty_like(rewards)
    for g in np.unique(gid):
        i = np.flatnonzero(gid == g)
        loo[i] = (rewards[i].sum() - rewards[i]) / max(len(i) - 1, 1)
    return explained_variance(per_token(loo, batch), per_token(rewards, batch), batch.loss_mask)


def run_row(name: str, ckpt: Path, steps: list, cfg: tuple) -> dict:
    lr, updates, clip, lam, head = cfg
    torch.manual_seed(0)
    model, _ = load_teacher(str(ckpt), torch.float32)
    critic = Critic(model, CriticConfig(lr=lr, weight_decay=0.0, value_clip=clip, updates_per_step=updates))
    with torch.no_grad():
        w = critic.model.value_head.weight
        std = {"zero": 0.0, "random": 0.02, "small": 1e-3}[head]
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * std)
    ev, share, t0 = [], [], time.perf_counter()
    for batch, rewards, gid, turn in steps:
        old = critic.values(batch)
        old = torch.where(batch.loss_mask > 0, old, torch.zeros_like(old))
        r_tok = token_rewards(rewards, batch.offsets, batch.loss_mask, turn)
        _, ret = gae(r_tok, old, batch.offsets, batch.loss_mask, turn, 1.0, lam)
        R = per_token(rewards, batch)
        ev.append(explained_variance(old, R, batch.loss_mask))
        m = batch.loss_mask > 0
        share.append(float(ret[m].double().var() / R[m].double().var()))
        critic.train(critic_batch(batch, old, ret), update_splits(gid, updates))
    half = ev[len(ev) // 2:]
    row = {"lr": lr, "updates_per_step": updates, "value_clip": clip, "lam": lam, "head": head,
           "ev": [round(x, 4) for x in ev], "ev_last_half": round(float(np.mean(half)), 4),
           "lambda_target_share": round(float(np.mean(share)), 3), "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"{name:>18}  EV per step {' '.join(f'{x:+.3f}' for x in ev)}  last half {row['ev_last_half']:+.3f}"
          f"  target var share {row['lambda_target_share']:.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", default="0-7", help="step files to feed, in order: A-B (inclusive)")
    ap.add_argument("--groups", type=int, default=8, help="groups (prompts) of each step to use")
    ap.add_argument("--rows", default=",".join(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    a, b = (int(x) for x in args.steps.split("-"))
    steps = [load_step(args.run / "trace" / f"step_{k:06d}.h5", args.groups) for k in range(a, b + 1)]
    ceiling = [prompt_ceiling(bt, r, g) for bt, r, g, _ in steps]
    print(f"prompt ceiling (leave-one-out group mean) per step: {' '.join(f'{x:+.3f}' for x in ceiling)}")
    ckpt = args.run / "checkpoints" / "step_000000"
    rows = {name: run_row(name, ckpt, steps, ROWS[name]) for name in args.rows.split(",")}
    print(json.dumps({"run": str(args.run), "steps": args.steps, "groups": args.groups,
                      "prompt_ceiling": round(float(np.mean(ceiling)), 4),
                      "prompt_ceiling_per_step": [round(x, 4) for x in ceiling], "rows": rows}))


if __name__ == "__main__":
    main()
