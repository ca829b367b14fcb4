"""Record a TRL GRPO run as an AxRL trace, then debug it with `axrl-debug`.

    python examples/trl_grpo.py --run-dir runs/trl_grpo          # a few steps on CPU, offline
    axrl-debug summary runs/trl_grpo
    axrl-debug spikes runs/trl_grpo
    axrl-debug tui runs/trl_grpo

The policy is a tiny random MoE written by `axrl model init` (pass `--model DIR` for any Hugging
Face directory, e.g. one `axrl model export` wrote); the task is the quickstart's arithmetic
(`data.task: arithmetic`), its prompts rendered with the model's chat template into an in-memory
dataset, its reward the task's own verifier. Nothing is downloaded. Only the two lines marked
`AxRL` are specific to AxRL: the rest is a plain `trl.GRPOTrainer` script.

Without vLLM generation TRL has no engine logprobs, so `mismatch` has nothing to compare; the
trainer's logprobs, rewards, advantages, groups and tokens are all recorded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def arithmetic_prompts(tokenizer, n: int, seed: int):
    """`n` prompts of the arithmetic task as the model's chat-template text, and a TRL reward
    function that scores a completion with the task's own env (one fresh env per completion)."""
    from itertools import islice

    from axrl.agents.tasks import get_task

    task = get_task("arithmetic")
    by_chat = {}
    for prompt in islice(task.prompts(seed), n):
        opening = task.make_env().reset(prompt)
        by_chat[tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)] = prompt

    def reward(prompts, completions, **_):
        scores = []
        for chat, completion in zip(prompts, completions):
            env = task.make_env()
            env.reset(by_chat[chat])
            scores.append(float(env.step(completion).reward))
        return scores
    return list(by_chat), reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="where the AxRL trace goes (must not exist)")
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face model directory (default: a new "
                    "random micro-moe from `axrl model init`, written next to the run)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps (two per recorded step)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model
    if model is None:
        model = args.run_dir.parent / (args.run_dir.name + "_model")
        subprocess.run([sys.executable, "-m", "axrl.cli", "model", "init", "--preset", "micro-moe",
                        "--out", str(model)], check=True)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from axrl.integrations.trl_grpo import record_grpo   # AxRL

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chats, reward = arithmetic_prompts(tokenizer, 16, seed=0)
    # Two optimizer steps per generation batch (8 samples: 2 prompts × 4): TRL then computes the
    # trainer's logprobs of the batch at generation time ("old" logprobs, recorded as AxRL's
    # /tokens/old_logprob); fully on-policy it skips them and the trace has none.
    config = GRPOConfig(output_dir=str(args.run_dir.parent / (args.run_dir.name + "_trl")), max_steps=args.steps,
                        per_device_train_batch_size=4, steps_per_generation=2, num_generations=4,
                        max_completion_length=16,
                        learning_rate=2e-3, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                        logging_steps=1000, seed=0)
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": chats}), processing_class=tokenizer)
    recording = record_grpo(trainer, args.run_dir)       # AxRL: every generation batch becomes a step
    trainer.train()
    print(f"recorded steps {recording.steps} to {args.run_dir}; try `axrl-debug summary {args.run_dir}`")


if __name__ == "__main__":
    main()
