"""Trainer forward+backward, prefix-merged (`train.prefix_merge`) vs unmerged, side by side.

Two batches, one torch backend each way on identical weights (`--preset`, random init), the same
policy loss, 1 thread, the default micro-batch budget (4096 tokens):

(a) `calculator`: GRPO groups of 8 on the calculator task with the tool schema shown — each
    group's samples share the rendered prompt (system + tool schema + question, real tokenizer)
    and have their own `--answer-len` answer tokens;
(b) `per_turn`: per-turn samples of `--turns`-turn episodes — sample k of an episode is its
    stream up to the end of turn k, so each is a prefix of the next.

The two ways take turns (`--repeats` rounds, median) so machine noise hits both alike. Tokens
computed: what the forward runs over — padded [b, S] slots unmerged, tree slots merged. Before
timing, the max |Δ| of logprobs between the two (they compute the same function; at random init
logits are near uniform, so this is a smoke check — on trained weights and against the engine's
logprobs see bench/prefix_merge_exactness.py).

    python bench/prefix_merge.py [--preset tiny-moe] [--groups 2] [--repeats 5]

Last line: JSON with `merged_vs_unmerged_train_speedup` (case a) and the per-case figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.agents.tasks import get_task  # noqa: E402
from axrl.model import build_model, preset_config  # noqa: E402
from axrl.tokenizer import Tokenizer  # noqa: E402
from axrl.train import LossContext, PackedBatch, TorchBackend, TorchBackendConfig  # noqa: E402
from axrl.train.micro_batch import micro_batches  # noqa: E402
from axrl.train.prefix_tree import build_prefix_tree  # noqa: E402


def pack(samples: list[list[int]], loss: list[list[int]], seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(s) for s in samples])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    T = int(lengths.sum())
    return PackedBatch(input_ids=torch.tensor([t for s in samples for t in s]), offsets=offsets,
                       loss_mask=torch.tensor([x for m in loss for x in m], dtype=torch.float32),
                       advantages=torch.randn(T, generator=g), temperature=0.7)


def calculator_batch(tok: Tokenizer, groups: int, group_size: int, answer_len: int, vocab: int) -> PackedBatch:
    task = get_task("calculator", show_tool_schema=True)
    rnd = random.Random(0)
    samples, loss = [], []
    for g in range(groups):
        env = task.make_env()
        prompt = tok.apply_chat_template(env.reset(task.prompt(0, g)), tools=env.tools, add_generation_prompt=True)
        for _ in range(group_size):
            answer = [rnd.randrange(vocab) for _ in range(answer_len)]
            samples.append(list(prompt) + answer)
            loss.append([0] * len(prompt) + [1] * answer_len)
    return pack(samples, loss)


def per_turn_batch(episodes: int, turns: int, prompt_len: int, answer_len: int, obs_len: int, vocab: int) -> PackedBatch:
    rnd = random.Random(1)
    tok = lambda n: [rnd.randrange(vocab) for _ in range(n)]  # noqa: E731
    samples, loss = [], []
    for _ in range(episodes):
        stream, mask = tok(prompt_len), [0] * prompt_len
        for t in range(turns):
            if t:
                stream, mask = stream + tok(obs_len), mask + [0] * obs_len
            # Per-turn sample: trained on its own (last) turn only, earlier turns are context.
            stream, mask = stream + tok(answer_len), [0] * len(mask) + [1] * answer_len
            samples.append(list(stream))
            loss.append(list(mask))
    return pack(samples, loss)


def loss_fn(logprobs, entropy, mb: PackedBatch, ctx: LossContext):
    return -(mb.advantages * logprobs * mb.loss_mask).sum() / ctx.num_loss_tokens, {}


def tokens_computed(batch: PackedBatch, merged: bool, budget: int) -> int:
    mbs = micro_batches(batch, budget, merged=merged)
    if merged:
        return sum(build_prefix_tree(mb).num_slots for mb in mbs)
    return sum(mb.num_samples * int(mb.lengths.max()) for mb in mbs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--groups", type=int, default=2, help="calculator: prompts (groups of 8)")
    ap.add_argument("--answer-len", type=int, default=40)
    ap.add_argument("--episodes", type=int, default=2, help="per_turn: episodes")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.default()
    cfg = preset_config(args.preset, vocab_size=tok.vocab_size)
    backends = {m: TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(
        lr=1e-4, num_threads=1, micro_batch_tokens=args.micro_batch_tokens, prefix_merge=m)) for m in (False, True)}
    cases = {
        "calculator": calculator_batch(tok, args.groups, 8, args.answer_len, cfg.vocab_size),
        "per_turn": per_turn_batch(args.episodes, args.turns, 120, 32, 16, cfg.vocab_size),
    }
    out: dict[str, float] = {}
    for name, batch in cases.items():
        diff = float((backends[False].forward(batch).logprobs - backends[True].forward(batch).logprobs).abs().max())
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for merged, be in backends.items():
                t0 = time.perf_counter()
                be.forward_backward(batch, loss_fn)
                times[merged].append(time.perf_counter() - t0)
                be.optimizer.zero_grad(set_to_none=True)
        t_flat, t_merged = statistics.median(times[False]), statistics.median(times[True])
        n_flat = tokens_computed(batch, False, args.micro_batch_tokens)
        n_merged = tokens_computed(batch, True, args.micro_batch_tokens)
        prompt = int(batch.offsets[1]) - args.answer_len if name == "calculator" else 120
        print(f"{name:>10}: {batch.num_samples} samples, {batch.num_tokens} real tokens (prompt {prompt}); "
              f"tokens computed unmerged {n_flat}, merged {n_merged} ({n_flat / n_merged:.1f}x fewer); "
              f"fwd+bwd unmerged {t_flat * 1e3:.0f} ms, merged {t_merged * 1e3:.0f} ms "
              f"({t_flat / t_merged:.2f}x); max |dlogprob| {diff:.1e}")
        out.update({f"{name}_speedup": round(t_flat / t_merged, 2), f"{name}_tokens_unmerged": n_flat,
                    f"{name}_tokens_merged": n_merged, f"{name}_max_logprob_diff": diff})
    print(json.dumps({"merged_vs_unmerged_train_speedup": out["calculator_speedup"], **out}))


if __name__ == "__main__":
    main()
