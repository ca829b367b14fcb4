"""Merged vs unmerged trainer logprobs on trained weights: on the same weights, and across two runs.

Issue 25 compared step 0 of two quickstart runs (tool schema shown, 20 warm-up steps), one with
`train.prefix_merge`, and found their trainer logprobs up to 1.1e-4 apart. This script separates
what the merged forward does from what a merged *run* does:

1. Three warm-ups from the same init, each built and run as `axrl train` builds and runs it
   (`examples/quickstart.yaml` with the schema shown; the run's backend, `warm_up`): A unmerged,
   B merged (a merged run's warm-up trains merged too), and D unmerged from A's init with every
   weight moved by one ulp — a rounding-sized perturbation, as a control.
2. A step-0 rollout from A's weights on the run's embedded engine: the first `--prompts` prompts
   of the run × 8 single-turn samples of `--answer-len` tokens at the run's temperature.
3. Trainer logprobs over that rollout's sampled tokens:
   - same weights (A's): merged vs unmerged, and each vs the engine's logprobs;
   - separate runs, as the issue compared them: run B (its own weights, merged) vs run A, and the
     control, run D (its own weights, unmerged) vs run A.

    python bench/prefix_merge_exactness.py [--warmup-steps 20] [--prompts 16]

Last line: JSON with the max/mean |Δ| and the fraction of tokens over 1e-5 of each comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.agents.tasks import Task  # noqa: E402
from axrl.assembly.settings import backend_settings, data_settings, model_source, rollout_settings  # noqa: E402
from axrl.config import load_config  # noqa: E402
from axrl.data import PromptLoader  # noqa: E402
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams  # noqa: E402
from axrl.model import load_weights_into  # noqa: E402
from axrl.runtime.components import (embedded_engine_for, make_data, make_engine_model, make_tokenizer,  # noqa: E402
                                     make_train_backend)
from axrl.runtime.warmup import warm_up  # noqa: E402
from axrl.tokenizer import Tokenizer  # noqa: E402
from axrl.train import PackedBatch, TrainBackend  # noqa: E402

GROUP = 8


def nudge_by_one_ulp_(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every weight to a neighbouring float32, up or down at random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            up = torch.rand(p.shape, generator=g) < 0.5
            p.copy_(torch.nextafter(p, torch.where(up, torch.tensor(float("inf")), torch.tensor(float("-inf")))))


def rollout(engine: EmbeddedEngine, tok: Tokenizer, task: Task, loader: PromptLoader, prompts: int,
            answer_len: int, temperature: float) -> tuple[PackedBatch, torch.Tensor]:
    """GRPO groups of GROUP single-turn samples on the run's first `prompts` prompts, and the
    engine's logprob of each token (0 on prompt tokens)."""
    reqs = []
    for i in range(prompts):
        env = task.make_env()
        messages = env.reset(loader.prompt_at(i))
        prompt = tok.apply_chat_template(messages, tools=env.tools, add_generation_prompt=True)
        for j in range(GROUP):
            sp = SamplingParams(max_new_tokens=answer_len, temperature=temperature, seed=GROUP * i + j)
            reqs.append(GenerateRequest(list(prompt), sp, return_logprob=True))
    samples, loss, logprobs = [], [], []
    for req, res in zip(reqs, engine.generate_batch(reqs)):
        n = len(req.input_ids)
        samples.append(req.input_ids + res.output_ids)
        loss += [0.0] * n + [1.0] * len(res.output_ids)
        logprobs += [0.0] * n + res.output_logprobs
    lengths = torch.tensor([len(s) for s in samples])
    batch = PackedBatch(input_ids=torch.tensor([t for s in samples for t in s]),
                        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                        loss_mask=torch.tensor(loss), temperature=temperature)
    return batch, torch.tensor(logprobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--answer-len", type=int, default=40)
    args = ap.parse_args()
    cfg = load_config(ROOT / "examples" / "quickstart.yaml", [
        "data.task_args.show_tool_schema=true", "rollout.max_context_len=512", f"warmup.steps={args.warmup_steps}",
        "runtime.threads=1"])
    source, settings = model_source(cfg), backend_settings(cfg)
    tok = make_tokenizer(source)
    task, loader = make_data(data_settings(cfg))

    def trainer(merged: bool) -> TrainBackend:
        return make_train_backend(source, dataclasses.replace(
            settings, config=settings.config.model_copy(update={"prefix_merge": merged})), tok)

    # Each run as `axrl train` warms up: its own backend (merged for B), from the same init.
    runs = {"A": trainer(False), "B": trainer(True), "D": trainer(False)}
    nudge_by_one_ulp_(runs["D"].model)
    for be in runs.values():
        warm_up(be, tok, task, steps=cfg.warmup.steps, batch_size=cfg.warmup.batch_size, lr=cfg.warmup.lr,
                seed=cfg.seed)
    a_weights = dict(runs["A"].named_weights())
    model = make_engine_model(source, runs["A"].model_config, a_weights)
    with embedded_engine_for(rollout_settings(cfg).embedded, model, tok, clocked=False) as engine:
        batch, engine_lp = rollout(engine, tok, task, loader, args.prompts, args.answer_len, cfg.rollout.temperature)
    lp = {name: be.forward(batch).logprobs for name, be in runs.items()}
    same = trainer(True)  # merged, on run A's weights
    load_weights_into(same.model, a_weights)
    lp["A merged"] = same.forward(batch).logprobs
    on_loss = batch.loss_mask > 0

    out: dict[str, float] = {}

    def compare(key: str, label: str, x: torch.Tensor, y: torch.Tensor) -> None:
        d = (x - y)[on_loss].abs()
        out.update({f"{key}_max": float(d.max()), f"{key}_mean": float(d.mean()),
                    f"{key}_frac_over_1e-5": round(float((d > 1e-5).float().mean()), 4)})
        print(f"  {label:<44} max {d.max():.1e}  mean {d.mean():.1e}  > 1e-5: {(d > 1e-5).float().mean():6.2%}")

    print(f"quickstart (tiny-moe, schema shown), {args.warmup_steps} warm-up steps; step-0 rollout: "
          f"{batch.num_samples} samples, {int(on_loss.sum())} sampled tokens")
    print("same weights (run A's):")
    compare("same_weights_merged_vs_unmerged", "merged vs unmerged", lp["A merged"], lp["A"])
    compare("same_weights_unmerged_vs_engine", "unmerged vs engine", lp["A"], engine_lp)
    compare("same_weights_merged_vs_engine", "merged vs engine", lp["A merged"], engine_lp)
    print("separate runs (each its own warm-up):")
    compare("runs_merged_vs_unmerged", "run B (merged) vs run A (unmerged)", lp["B"], lp["A"])
    compare("runs_ulp_control_vs_unmerged", "run D (unmerged, init +-1 ulp) vs run A", lp["D"], lp["A"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
