"""Cost of recording what the objective did: the per-token columns `/tokens/is_weight`,
`/tokens/loss_rule` and the per-tensor `/train/param_grad_norm`, as a fraction of step time.

One process runs real quickstart steps (tiny MoE, `run_step` of the loop) and, for each step,
measures side by side, alternating order, repeated:

- record: `step_record` + `write_step` of the step with the new columns vs the same record with
  them left out (the trace without them), i.e. building the arrays + compressing + writing;
- collect: the loss over the update's micro-batches (on their recorded forward logprobs) plus the
  backend's split / concatenation of its outputs, with the per-token columns vs a loss whose
  columns are dropped (the forward and backward themselves do not change).

    python bench/objective_columns.py [--steps 6] [--repeats 5] [--set key=value ...]

Also: what the online spike trigger (`trace.spike_ratio`) costs a normal step, the copy of the
trainer state it keeps before each step (`TrainBackend.state_dict`).

Last line: JSON with `objective_columns_overhead_frac` (record + collect, / step time), its parts,
and `spike_trigger_snapshot_frac`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from axrl.config import load_config
from axrl.assembly.build import build_components, policy_loss
from axrl.console.progress import PhaseTimer, TrainProgress
from axrl.runtime.recording.builders import step_record
from axrl.runtime.warmup import warm_up
from axrl.train.metrics import TOKEN_COLUMN_PREFIX, join_token_columns, split_token_columns
from axrl.train.micro_batch import micro_batches
from axrl.train.protocol import LossContext
from axrl.trace import write_step

ROOT = Path(__file__).resolve().parents[1]
NEW_FIELDS = ("is_weight", "loss_rule", "param_names", "param_grad_norm")


class WithoutColumns:
    """The run's loss with its per-token columns dropped (what recording them adds to a step)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, logprobs, entropy, mb, ctx):
        loss, metrics = self.inner(logprobs, entropy, mb, ctx)
        return loss, {k: v for k, v in metrics.items() if not k.startswith(TOKEN_COLUMN_PREFIX)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", dest="extra", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "examples" / "quickstart.yaml",
                      ["warmup.steps=20", "eval.every=0", "runtime.threads=1", *args.extra])
    c = build_components(cfg)
    warm_up(c.backend, c.tokenizer, c.task, steps=cfg.warmup.steps, batch_size=cfg.warmup.batch_size,
            lr=cfg.warmup.lr, seed=cfg.seed)
    c.backend.reset_optimizer()
    c.rollout.load_weights(c.backend.sync_source(), 0)
    c.rollout.start(0)
    step_s, rec_with, rec_without, col_with, col_without, snap = [], [], [], [], [], []
    loss = policy_loss(cfg)
    with tempfile.TemporaryDirectory() as tmp, TrainProgress(args.steps) as progress:
        for step in range(args.steps):
            timer = PhaseTimer(progress)
            t0 = time.perf_counter()
            with timer("rollout"):
                batch = c.pool.take(step)
            outcome = c.trainer.step(batch, step, timer)
            step_s.append(time.perf_counter() - t0)
            full = step_record(outcome)
            assert full.is_weight is not None and full.param_grad_norm is not None
            batch = outcome.processed.batch.select(outcome.updates[0].samples)
            mbs = micro_batches(batch, cfg.train.micro_batch_tokens)
            ctx = LossContext.of(batch)
            fwd = [c.backend.forward(mb) for mb in mbs]
            for r in range(args.repeats):
                for order in ((True, False) if r % 2 == 0 else (False, True)):
                    def record(with_cols: bool = order) -> None:
                        rec = step_record(outcome)
                        if not with_cols:
                            rec = dataclasses.replace(rec, **{f: None for f in NEW_FIELDS})
                        write_step(Path(tmp) / f"{step}-{r}-{with_cols}", rec)

                    def collect(fn=loss if order else WithoutColumns(loss)) -> None:
                        parts = [split_token_columns(fn(f.logprobs, f.entropy, mb, ctx)[1], mb.num_tokens)[1]
                                 for f, mb in zip(fwd, mbs)]
                        join_token_columns(parts)
                    (rec_with if order else rec_without).append(timed(record))
                    (col_with if order else col_without).append(timed(collect))
                snap.append(timed(c.backend.state_dict))
    c.close()
    step_time = statistics.median(step_s[1:] or step_s)
    record_cost = statistics.median(rec_with) - statistics.median(rec_without)
    # once per update: the collection cost scales with updates_per_step
    collect_cost = (statistics.median(col_with) - statistics.median(col_without)) * cfg.train.updates_per_step
    print(f"median step time {step_time:.3f} s ({args.steps} steps, tiny MoE, quickstart shapes)")
    print(f"record step file: {statistics.median(rec_with) * 1e3:.2f} ms with the new columns, "
          f"{statistics.median(rec_without) * 1e3:.2f} ms without")
    print(f"loss + split/concat over an update's micro-batches: {statistics.median(col_with) * 1e3:.2f} ms with "
          f"per-token columns, {statistics.median(col_without) * 1e3:.2f} ms without")
    print(f"spike trigger's state copy before a step: {statistics.median(snap) * 1e3:.2f} ms")
    print(json.dumps({"objective_columns_overhead_frac": round((record_cost + collect_cost) / step_time, 5),
                      "record_overhead_frac": round(record_cost / step_time, 5),
                      "collect_overhead_frac": round(collect_cost / step_time, 5),
                      "spike_trigger_snapshot_frac": round(statistics.median(snap) / step_time, 5),
                      "step_time_s": round(step_time, 3)}))


if __name__ == "__main__":
    main()
